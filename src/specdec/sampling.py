"""Sampling parameters and the one function that turns logits into a distribution.

``logits_to_probs`` serves plain decoding, draft sampling and verification alike: the
target distribution ``p`` that speculative decoding preserves is exactly the one plain
decoding samples from, with temperature, top-k, top-p and min-p applied identically.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from specdec.argmax import argmax
from specdec.errors import SpecDecError
from specdec.logprobs import MAX_LOGPROBS
from specdec.structured.params import StructuredOutputsParams
from specdec.vllm_names import VLLMNames

if TYPE_CHECKING:
    from specdec.penalties import DraftAdjuster
    from specdec.structured.state import GrammarState

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy: ``logits / temperature`` would overflow (and the
distribution is a one-hot on the argmax anyway, up to ties)."""

MAX_SEED = 2**64 - 1
MAX_STOP_STRINGS = 16
"""Most stop strings one request may have (OpenAI's API allows 4)."""
MAX_STOP_LENGTH = 256
"""Longest stop string, in characters (a stream holds back this many characters, less one)."""
MAX_BAD_WORDS = 1024
"""Most ``bad_words`` one request may have, each of at most :data:`MAX_STOP_LENGTH` characters (every step
compares each with the output's end)."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_seed(value: object) -> bool:
    """Whether ``value`` is a seed: an integer (not a bool) in 0..:data:`MAX_SEED`."""
    return _is_int(value) and 0 <= value <= MAX_SEED


def _is_number(value: object) -> bool:
    """A finite int or float (not a bool); an int too large for a float (``10**400``) is not one."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_text(text: str, what: str) -> None:
    """Raise SpecDecError when ``text`` cannot be encoded as UTF-8 (a lone surrogate, such as the
    ones Python makes of a non-UTF-8 command-line argument)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SpecDecError(
            f"{what} is not valid UTF-8 text: lone surrogate {text[exc.start]!r} at character {exc.start}"
        ) from None


VLLM_NEUTRAL = {
    "best_of": (None, 1), "detokenize": (True,), "spaces_between_special_tokens": (True,),
    "logits_processors": (None, []), "truncate_prompt_tokens": (None,), "extra_args": (None, {}),
}
"""vLLM's ``SamplingParams`` fields that specdec does not implement, with the values that change nothing: given
so, they are accepted (code written for vLLM runs); given otherwise, :class:`SpecDecError` names them."""


@dataclass(frozen=True, kw_only=True)  # by keyword only: vLLM's first positional field is n, here not a field
class SamplingParams(metaclass=VLLMNames):
    """How one request samples and when it stops (vLLM's names and defaults). Immutable: every
    field is validated once, at construction (``dataclasses.replace`` builds a new, validated one).

    ``temperature=0`` is greedy decoding, and so is any temperature below
    :data:`GREEDY_TEMPERATURE`. ``top_k`` of 0 or -1 disables top-k. ``max_tokens=None``: as many as the
    context leaves (vLLM's meaning). A fixed ``seed`` (an
    integer in ``0..2**64-1``) makes a request's random numbers the same whatever else runs in the same
    process (its tokens too where the arithmetic does not depend on the batch: float64, or deterministic mode).
    ``stop`` strings end generation; the returned text excludes the stop string (at most
    :data:`MAX_STOP_STRINGS` strings of at most :data:`MAX_STOP_LENGTH` characters).
    ``stop`` and ``stop_token_ids`` are stored as tuples. ``structured_outputs``: a constraint on the
    output (a :class:`~specdec.structured.StructuredOutputsParams` or a dict of its fields; JSON schema,
    regex, choice or grammar), exact under speculation (docs/structured-output.md). ``logprobs``: None, or
    return the chosen token's log probability and those of the ``logprobs`` most likely tokens
    (0 to :data:`~specdec.logprobs.MAX_LOGPROBS`, 20) at every output position (vLLM's meaning; the target's raw
    distribution, see :mod:`specdec.logprobs`). ``prompt_logprobs``: the same for every prompt token but the first
    (vLLM's ``RequestOutput.prompt_logprobs``; such a request reads nothing from the prefix cache). ``min_tokens``:
    the stop tokens (``stop_token_ids`` and, unless ``ignore_eos``, end-of-sequence) cannot be generated, and stop
    strings do not end the output, before this many output tokens (vLLM's meaning; exact under speculation,
    :mod:`specdec.min_tokens`).
    ``include_stop_str_in_output``: the text keeps the stop string, or the stop token's text, that ended it (by
    default both are left out, as in vLLM; the stop token is among the output's ``token_ids`` either way).
    ``skip_special_tokens``: the text leaves special tokens out (vLLM's default); False keeps them (a chat
    template's tags, a model's tool-call token), the stop token's text still left out as above.
    ``thinking_token_budget``: with an ``LLM(reasoning_parser=...)``, a reasoning model thinks at most this many
    tokens (0: none), then ``</think>`` must follow (vLLM's name and meaning; one grammar with the answer's
    constraint, so exact under speculation: :mod:`specdec.structured.thinking`).

    ``n``: outputs per prompt (``LLM.generate`` and ``chat``; a seeded request's output ``i`` samples with
    ``seed + i``, so output 0 is what ``n=1`` returns). ``presence_penalty`` and ``frequency_penalty`` (in
    ``[-2, 2]``), ``repetition_penalty`` (above 0; 1 is none), ``logit_bias`` (``{token id: bias}``, added to the
    logits), ``allowed_token_ids`` (every other token is banned) and ``bad_words`` (a word's last token is banned
    where the output ends with the tokens before it): vLLM's adjustments of the target's logits, in
    vLLM's order and with its meanings (the frequency and presence penalties count output tokens, the repetition
    penalty prompt tokens too), exact under speculation (:mod:`specdec.penalties`).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = 16
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    allowed_token_ids: tuple[int, ...] | list[int] | None = None
    bad_words: tuple[str, ...] | list[str] | None = None
    skip_special_tokens: bool = True
    thinking_token_budget: int | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False, compare=False)
    vllm_names = (VLLM_NEUTRAL, {"guided_decoding": " (vLLM's earlier name of structured_outputs)"},
                  "field")  # not a field: no annotation

    def __post_init__(self) -> None:
        if not _is_number(self.temperature):
            raise SpecDecError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise SpecDecError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise SpecDecError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise SpecDecError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise SpecDecError(f"top_k must be an integer >= -1 (0 or -1 disable it), got {self.top_k!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise SpecDecError(f"max_tokens must be None or an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise SpecDecError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise SpecDecError(f"skip_special_tokens must be True or False, got {self.skip_special_tokens!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise SpecDecError(f"include_stop_str_in_output must be True or False, got "
                               f"{self.include_stop_str_in_output!r}")
        if self.seed is not None and not is_seed(self.seed):
            raise SpecDecError(f"seed must be None or an integer in 0..2**64-1, got {self.seed!r}")
        if isinstance(self.stop, (list, tuple)) and len(self.stop) > MAX_STOP_STRINGS:
            raise SpecDecError(f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        stops = self._sequence(self.stop, "stop", str)
        if any(not s for s in stops):
            raise SpecDecError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if any(len(s) > MAX_STOP_LENGTH for s in stops):
            longest = max(len(s) for s in stops)
            raise SpecDecError(f"stop has a string of {longest} characters; at most {MAX_STOP_LENGTH} are allowed")
        for s in stops:
            check_text(s, "a stop string")
        ids = self._sequence(self.stop_token_ids, "stop_token_ids", int)
        if any(not _is_int(t) or t < 0 for t in ids):
            raise SpecDecError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise SpecDecError(f"{name} must be None or an integer in 0..{MAX_LOGPROBS}, got {value!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= (self.max_tokens or math.inf):
            raise SpecDecError(f"min_tokens must be an integer in 0..max_tokens ({self.max_tokens}), "
                               f"got {self.min_tokens!r}")
        self._check_adjustments()
        budget = self.thinking_token_budget
        if budget is not None and (not _is_int(budget) or budget < 0):
            raise SpecDecError(f"thinking_token_budget must be None or an integer >= 0, got {budget!r}")
        if self.structured_outputs is not None or budget is not None:
            what = "structured_outputs" if self.structured_outputs is not None else "thinking_token_budget"
            if self.min_tokens:
                raise SpecDecError(f"min_tokens cannot be combined with {what}: its grammar decides where the "
                                   "output may end")
            if self.allowed_token_ids is not None:
                raise SpecDecError(f"allowed_token_ids cannot be combined with {what}: its grammar decides which "
                                   "tokens may follow")
        if self.structured_outputs is not None:
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams.from_dict(self.structured_outputs))
        object.__setattr__(self, "stop", stops or None)
        object.__setattr__(self, "stop_token_ids", ids)
        object.__setattr__(self, "stop_strings", stops)

    def _check_adjustments(self) -> None:
        """Check ``n``, the penalties, ``logit_bias``, ``allowed_token_ids`` and ``bad_words``; store the last
        three as a dict of ints to floats and tuples."""
        if not _is_int(self.n) or self.n < 1:
            raise SpecDecError(f"n must be an integer >= 1, got {self.n!r}")
        if self.seed is not None and self.seed + self.n - 1 > MAX_SEED:
            raise SpecDecError(f"seed is {self.seed} and n is {self.n}: output i samples with seed + i, and seed + "
                               f"n - 1 must be at most 2**64-1")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise SpecDecError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise SpecDecError(f"repetition_penalty must be a finite number above 0 (1 is none), got "
                               f"{self.repetition_penalty!r}")
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict) or not all(_is_int(t) and t >= 0 for t in bias):
                raise SpecDecError(f"logit_bias must be a dict of token ids (integers >= 0) to numbers, got "
                                   f"{bias!r:.80}")
            bad = {t: v for t, v in bias.items() if not _is_number(v)}
            if bad:
                raise SpecDecError(f"logit_bias values must be finite numbers, got {bad!r:.80}")
            object.__setattr__(self, "logit_bias", {t: float(v) for t, v in bias.items()} or None)
        if self.allowed_token_ids is not None:
            ids = self._sequence(self.allowed_token_ids, "allowed_token_ids", int)
            if not ids or any(not _is_int(t) or t < 0 for t in ids):
                raise SpecDecError(f"allowed_token_ids must be None or a non-empty list of token ids (integers >= 0),"
                                   f" got {self.allowed_token_ids!r:.80}")
            object.__setattr__(self, "allowed_token_ids", tuple(dict.fromkeys(ids)))
        words = self._sequence(self.bad_words, "bad_words", str)
        if len(words) > MAX_BAD_WORDS:
            raise SpecDecError(f"bad_words has {len(words)} words; at most {MAX_BAD_WORDS} are allowed")
        for word in words:
            check_text(word, "bad_words")
            if not word.strip() or len(word) > MAX_STOP_LENGTH:
                raise SpecDecError(f"bad_words must be words (not blank) of at most {MAX_STOP_LENGTH} characters, "
                                   f"got {word!r:.80}")
        object.__setattr__(self, "bad_words", words or None)

    def choices(self) -> list[SamplingParams]:
        """The parameters of each of the ``n`` outputs, ``n`` 1 in each: choice ``i`` of a seeded request
        samples with ``seed + i``; choice 0 alone computes the prompt's logprobs."""
        if self.n == 1:
            return [self]
        return [replace(self, n=1, seed=None if self.seed is None else self.seed + i,
                        prompt_logprobs=self.prompt_logprobs if i == 0 else None) for i in range(self.n)]

    @property
    def penalizes(self) -> bool:
        """Whether a repetition, frequency or presence penalty is set."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether the parameters change the target's logits before sampling (:mod:`specdec.penalties`)."""
        return (self.penalizes or bool(self.logit_bias) or self.allowed_token_ids is not None
                or self.bad_words is not None)

    @staticmethod
    def _sequence(value: object, name: str, kind: type) -> tuple:
        """``value`` (None, one ``kind`` or a list/tuple) as a tuple; anything else is a SpecDecError."""
        if value is None:
            return ()
        if kind is str and isinstance(value, str):
            return (value,)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, kind) for v in value):
            plural = "strings" if kind is str else "integers"
            raise SpecDecError(f"{name} must be a list of {plural}, got {value!r}")
        return tuple(value)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def __getattr__(self, name: str):
        """vLLM's fields that specdec does not implement read as the neutral value it applies (``params.n`` is 1),
        so that code written for vLLM that reads them runs; any other unknown name is an ``AttributeError``."""
        if name in VLLM_NEUTRAL:
            return VLLM_NEUTRAL[name][0]
        raise AttributeError(f"'SamplingParams' object has no attribute {name!r}")

    def clone(self) -> SamplingParams:
        """A copy (vLLM's ``clone``); the parameters are immutable, so it equals this one."""
        return replace(self)


class SamplingBatch:
    """Per-row sampling parameters of a batch, and each row's generator.

    ``params[b]`` and ``generators[b]`` belong to row ``b``. Every random number of a row comes
    from its own generator, in an order that depends on that row alone, so a seeded request
    draws the same random numbers alone or in any batch. The parameters reach the device as tensors
    (``temperature``, ``top_p``, ``min_p`` ``[B]`` float64, ``top_k`` ``[B]`` int64 with 0 for
    off, ``greedy`` ``[B]`` bool) only when a sampled row needs them: an all-greedy step copies
    nothing to the device.

    ``grammars[b]``: row ``b``'s grammar state under a constraint (None without one); ``grammars`` is None
    when no row is constrained, and then drafting does no constraint work at all
    (:meth:`constrain_draft`, :meth:`advance_draft`).

    ``adjuster`` and ``members[b]`` (row ``b``'s index in it, None where the row does not adjust): the step's
    :class:`~specdec.penalties.DraftAdjuster` when a row adjusts its logits (penalties, biases) and a drafter
    draws; drafters then draw from adjusted logits (:meth:`adjust_draft`).

    ``positions[b]`` (the deterministic mode): the index in its sequence of the token row ``b`` samples
    next. Given, the batch is *keyed* (:mod:`specdec.keyed_noise`): a sampled row's noise for the token at
    index ``t`` is a function of its generator's seed and ``t`` alone, not of how many numbers its
    generator gave before, and verification matches drafts against those samples
    (:func:`specdec.verify.verify_sampled`).
    """

    def __init__(self, params: list[SamplingParams], generators: list[torch.Generator | None],
                 device: torch.device, grammars: list[GrammarState | None] | None = None,
                 positions: list[int] | None = None, adjuster: DraftAdjuster | None = None,
                 members: list[int | None] | None = None) -> None:
        self.params, self.generators, self.device = list(params), list(generators), device
        self.positions = None if positions is None else list(positions)
        self.grammars = grammars if grammars is not None and any(g is not None for g in grammars) else None
        adjusting = adjuster is not None and members is not None and any(m is not None for m in members)
        self.adjuster, self.members = (adjuster, list(members)) if adjusting else (None, None)
        self.greedy_rows = [p.greedy for p in self.params]
        self.all_greedy = all(self.greedy_rows)
        self.any_top_k = any(p.top_k > 0 for p in self.params)
        self.any_top_p = any(p.top_p < 1.0 for p in self.params)
        self.any_min_p = any(p.min_p > 0.0 for p in self.params)

    @cached_property
    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        from specdec.models.base import to_device

        floats = to_device([[p.temperature if not p.greedy else 1.0, p.top_p, p.min_p] for p in self.params],
                           self.device, torch.float64)
        # A top_k past the vocabulary keeps every token (clamped below), and past int64 would not fit.
        ints = to_device([[min(p.top_k, 2**63 - 1) if p.top_k > 0 else 0, p.greedy] for p in self.params],
                         self.device)
        return floats, ints

    @property
    def temperature(self) -> torch.Tensor:
        return self._tensors[0][:, 0]

    @property
    def top_p(self) -> torch.Tensor:
        return self._tensors[0][:, 1]

    @property
    def min_p(self) -> torch.Tensor:
        return self._tensors[0][:, 2]

    @property
    def top_k(self) -> torch.Tensor:
        return self._tensors[1][:, 0]

    @property
    def greedy(self) -> torch.Tensor:
        return self._tensors[1][:, 1].bool()

    def select(self, rows: list[int]) -> SamplingBatch:
        """The sub-batch of ``rows``."""
        grammars = None if self.grammars is None else [self.grammars[r] for r in rows]
        positions = None if self.positions is None else [self.positions[r] for r in rows]
        members = None if self.members is None else [self.members[r] for r in rows]
        return SamplingBatch([self.params[r] for r in rows], [self.generators[r] for r in rows], self.device,
                             grammars, positions, self.adjuster, members)

    def plain(self) -> SamplingBatch:
        """The same rows drafting from their plain logits: no constraints, no adjustments."""
        if not self.shapes_drafts:
            return self
        return SamplingBatch(self.params, self.generators, self.device, positions=self.positions)

    @property
    def keyed(self) -> bool:
        """Whether the noise is keyed by token index (the deterministic mode; see the class docstring)."""
        return self.positions is not None

    def shifted(self, offsets: list[int]) -> SamplingBatch:
        """The same rows, row ``b`` sampling the token ``offsets[b]`` further on next (a drafter that emitted
        tokens before drafting again, as the cascade's middle model does); unchanged when not keyed."""
        if self.positions is None:
            return self
        return SamplingBatch(self.params, self.generators, self.device, self.grammars,
                             [p + o for p, o in zip(self.positions, offsets)], self.adjuster, self.members)

    @property
    def constrained(self) -> bool:
        """Whether some row is under a constraint."""
        return self.grammars is not None

    @property
    def shapes_drafts(self) -> bool:
        """Whether some row's draft logits are changed before a draft token is drawn (a constraint, an
        adjustment): its drafts depend on the ones before, so a drafter draws them one position at a time."""
        return self.grammars is not None or self.adjuster is not None

    def constrain_draft(self, logits: torch.Tensor) -> torch.Tensor:
        """A drafter's logits ``[B, V]`` for the next draft token, the tokens a constrained row's grammar
        forbids after its drafts so far set to ``-inf`` (unchanged, and no work, without constraints)."""
        if self.grammars is None:
            return logits
        from specdec.structured.state import constrain_draft

        return constrain_draft(logits, self.grammars)

    def adjust_draft(self, logits: torch.Tensor) -> torch.Tensor:
        """A drafter's logits ``[B, V]`` for the next draft token, an adjusting row's adjusted for its output and
        drafts so far (:class:`~specdec.penalties.DraftAdjuster`; unchanged, and no work, without one)."""
        return logits if self.adjuster is None else self.adjuster.adjust(logits, self.members)

    def advance_draft(self, tokens: torch.Tensor) -> None:
        """The constrained rows' draft grammar states consume the drawn tokens ``[B]``, the adjusting rows count
        them (no-op without either)."""
        if self.adjuster is not None:
            self.adjuster.advance(tokens, self.members)
        if self.grammars is not None:
            from specdec.structured.state import advance_draft

            advance_draft(tokens, self.grammars)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The sampling distribution of each row: logits ``[B, ..., V]`` -> probabilities, same shape.

        Order: temperature, softmax, top-k, top-p, min-p, renormalise (vLLM's and transformers'
        order). Float64 logits stay float64 (exactness tests); anything else is computed in
        float32. Greedy rows get a one-hot distribution on the argmax. Ties at the k-th value are
        kept by top-k; top-p keeps at least the most likely token, however small ``top_p``.
        """
        work = logits if logits.dtype == torch.float64 else logits.float()
        extra = (1,) * (work.dim() - 2)
        greedy = torch.nn.functional.one_hot(argmax(work), work.shape[-1]).to(work.dtype)
        if self.all_greedy:
            return greedy
        # Parameters are float64; one past the work dtype's range would become inf or 0 there (a temperature
        # of 1e300 turned a grammar's -inf logits into NaN, a top_p of 1e-300 cut every token): clamped into it.
        finfo = torch.finfo(work.dtype)
        temperature = self.temperature.clamp(max=finfo.max).to(work.dtype).view(-1, *extra, 1)
        probs = torch.softmax(work / temperature, dim=-1)
        if self.any_top_k or self.any_top_p:
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            if self.any_top_k:
                k = torch.where(self.top_k > 0, self.top_k, work.shape[-1]).clamp(max=work.shape[-1])
                kth = sorted_probs.gather(-1, (k - 1).view(-1, *extra, 1).expand(*sorted_probs.shape[:-1], 1))
                sorted_probs = sorted_probs.masked_fill(sorted_probs < kth, 0.0)
            if self.any_top_p:
                # Renormalise (after top-k) only the rows that use top-p: dividing the others too would
                # change their last bits with the batch's composition (batch invariance).
                uses_top_p = (self.top_p < 1.0).view(-1, *extra, 1)
                sorted_probs = torch.where(uses_top_p, sorted_probs / sorted_probs.sum(-1, keepdim=True), sorted_probs)
                mass_before = sorted_probs.cumsum(-1) - sorted_probs
                top_p = torch.where(self.top_p < 1.0, self.top_p.clamp(min=finfo.tiny), torch.inf)
                top_p = top_p.to(work.dtype).view(-1, *extra, 1)  # above 0: the most likely token always stays
                sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        if self.any_min_p:
            threshold = self.min_p.to(work.dtype).view(-1, *extra, 1) * probs.amax(-1, keepdim=True)
            probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
        return torch.where(self.greedy.view(-1, *extra, 1), greedy, probs)

    def uniforms(self, counts: list[int], width: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """``[B, width]`` uniforms in [0, 1): row ``b`` draws ``counts[b]`` from its generator (greedy
        rows and the padding get 0, which accepts exactly the drafts equal to the argmax)."""
        out = torch.zeros(len(counts), width, device=device, dtype=dtype)
        for b, (count, gen) in enumerate(zip(counts, self.generators)):
            if count and not self.greedy_rows[b]:
                out[b, :count] = torch.rand(count, generator=gen, device=device, dtype=dtype)
        return out

    def sample(self, probs: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """One token per row of ``probs`` ``[B, V]`` -> ``[B]`` int64, exactly distributed as ``probs``.

        The exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. is distributed as ``p``;
        each row draws its ``E`` from its own generator (keyed: the noise of the token ``offset`` past
        its position); greedy rows draw nothing and get the argmax.
        """
        return argmax(probs / self.noise(probs, offset))

    def noise(self, probs: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """``[B, V]`` exponential noise for the race (ones for greedy rows), positive; keyed, that of the
        token ``offset`` past each row's position."""
        if self.positions is not None:
            return self.keyed_noise([[offset]] * len(self.params), probs.shape[-1], probs.dtype)[:, 0]
        noise = torch.ones_like(probs)
        for b, gen in enumerate(self.generators):
            if not self.greedy_rows[b]:
                noise[b].exponential_(generator=gen)
        return noise.clamp_min_(torch.finfo(probs.dtype).tiny)

    def keyed_noise(self, offsets: list[list[int | None]], vocab: int, dtype: torch.dtype) -> torch.Tensor:
        """``[B, C, V]`` keyed noise (the batch is keyed): row ``b``'s column ``c`` that of the token
        ``offsets[b][c]`` past its position (ones where None, and on greedy rows)."""
        from specdec.keyed_noise import keyed_noise

        keys = [gen.initial_seed() if gen is not None else 0 for gen in self.generators]
        indices = [[None if greedy or o is None else position + o for o in row]
                   for row, position, greedy in zip(offsets, self.positions, self.greedy_rows)]
        return keyed_noise(keys, indices, vocab, dtype, self.device)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution of one request: logits ``[..., V]`` -> probabilities ``[..., V]``
    (see :meth:`SamplingBatch.probs`)."""
    batch = SamplingBatch([params], [None], logits.device)
    flat = logits.reshape(1, -1, logits.shape[-1])
    return batch.probs(flat).reshape(logits.shape[:-1] + (logits.shape[-1],)).to(
        logits.dtype if logits.dtype == torch.float64 else torch.float32
    )
