"""The drafter interface, the speculative configuration and the registry of methods.

A drafter proposes draft tokens for a batch of sequences. The engine never inspects its
type: class attributes say what a method is, and a new method plugs in with
``@register_drafter`` without touching the engine, the CLI, the bench or the server, which
all derive their choices from :data:`DRAFTERS` (the one list of methods).
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from transformers import PreTrainedModel

from specdec.adaptive import AUTO, DEFAULT_MAX_SPECULATIVE_TOKENS
from specdec.argmax import argmax
from specdec.drafters.draft_vocab import check_draft_vocab_size
from specdec.errors import SpecDecError
from specdec.k_schedule import NAME as SCHEDULE
from specdec.k_schedule import parse_schedule
from specdec.metrics import BatchMetrics
from specdec.models.base import CausalLM, KVCache, to_device
from specdec.models.kv_budget import KVBudget
from specdec.models.loader import ModelSource
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence
from specdec.vllm_names import ANY, check_neutral

MAX_SPECULATIVE_TOKENS = 64
METHOD_FIELDS = frozenset({"dtype", "prompt_lookup_max", "prompt_lookup_min", "suffix_cache_max_tokens",
                           "suffix_factor", "suffix_min_prob", "skip_layers", "early_exit", "lookahead_window",
                           "lookahead_ngram", "lookahead_guesses"})
"""The :class:`SpeculativeConfig` fields only some methods read (``Drafter.reads``); the other method-specific fields
(``draft_confidence_threshold``, ``num_candidates``, ``draft_vocab_size``, ``candidates``, ``stages``, ``model``)
are checked by the drafters' own flags."""
MAX_CANDIDATES = 16


@dataclass
class SpeculativeConfig:
    """vLLM-style ``speculative_config``: which drafter, and how many tokens per step.

    ``method``: a registered drafter name (``"draft_model"``, ``"ngram"``); a dict given a ``model`` and no
    ``method`` gets the one its model means (:mod:`specdec.drafters.method_of`, as vLLM infers it). ``model``: the
    draft model's folder, hub id or a loaded ``PreTrainedModel`` (draft_model; several
    ``LLM``s can share one loaded draft). ``dtype``: the draft model's dtype (None: see
    :func:`specdec.drafters.draft_lm.resolve_draft_dtype`). ``prompt_lookup_max``/
    ``prompt_lookup_min``: the longest and shortest n-gram matched against the context (ngram).
    ``num_speculative_tokens="auto"``: each row's k per step from measured acceptance and cost
    (:mod:`specdec.adaptive`), at most ``max_num_speculative_tokens``. ``draft_confidence_threshold``:
    a drafter that supports it (``confidence_stop``) stops a row's draft before a position whose
    top draft probability is below it.
    ``suffix_cache_max_tokens``: the most tokens of earlier requests the suffix cache keeps
    (oldest evicted first); ``suffix_factor`` and ``suffix_min_prob``: a suffix draft's length is
    at most ``suffix_factor`` x match length x (1 + log2 of the continuation's count), and stops
    where fewer than ``suffix_min_prob`` of the matches agree with it (suffix). ``skip_layers``:
    the target's decoder layers the layer_skip draft leaves out (None: chosen by calibration).
    ``early_exit``: layer_skip's trained form, an adapter after an early exit layer (its ``model``
    folder from ``specdec train early-exit``; with no ``model``, the adapter shipped for the embedded
    target); a ``model`` given to layer_skip implies it.
    ``num_candidates``: a method with tree drafts proposes up to this many different
    continuations per step as a tree (1: a chain); ``num_speculative_tokens`` is then the most
    tree nodes per step. ``candidates``: the speculative configs (dicts or ``SpeculativeConfig``) a
    composite method (``"auto"``) chooses among, each validated as a config of its own. ``stages``: the
    speculative configs a staged method (``"cascade"``) chains, smallest first, validated the same way.
    ``lookahead_window`` (W), ``lookahead_ngram`` (N) and ``lookahead_guesses`` (G): lookahead's
    Jacobi window length, n-gram size (the window keeps N - 1 iterations of its trajectory) and
    most pooled n-grams per first token, which are also the most verification candidates per step.
    ``draft_vocab_size``: a method with ``draft_vocab`` scores only this many of the most frequent tokens
    (0: the whole vocabulary; None: the default stored with its folder's token counts, if any;
    :mod:`specdec.drafters.draft_vocab`).
    ``num_speculative_tokens_per_batch_size``: vLLM-style k by the step's number of rows, such as
    ``{1: 4, 8: 2, 32: 0}``, each k at most a fixed ``num_speculative_tokens`` (:mod:`specdec.k_schedule`):
    it overrides the policy, stored as ``(batch size, k)`` pairs.
    ``max_step_time_ratio``: with ``num_speculative_tokens="auto"``, a step drafts only as much as keeps its
    predicted time (calibrated by measurement) within this many plain steps of the same rows, such as 1.1,
    the prompt tokens it feeds besides included: a bound on the longest inter-token gap speculation adds, at the
    cost of shorter drafts (None: no bound; :mod:`specdec.adaptive`).
    A field only some methods read (:data:`METHOD_FIELDS`, ``Drafter.reads``), set away from its default for another
    method, is an error that names the methods reading it.
    """

    method: str
    num_speculative_tokens: int | str = 4
    model: ModelSource | None = None
    dtype: str | None = None
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    max_num_speculative_tokens: int = DEFAULT_MAX_SPECULATIVE_TOKENS
    draft_confidence_threshold: float | None = None
    suffix_cache_max_tokens: int = 1 << 18
    suffix_factor: float = 1.0
    suffix_min_prob: float = 0.1
    skip_layers: list[int] | None = None
    early_exit: bool = False
    num_candidates: int = 1
    candidates: list[Any] | None = None
    stages: list[Any] | None = None
    lookahead_window: int = 2
    lookahead_ngram: int = 4
    lookahead_guesses: int = 2
    draft_vocab_size: int | None = None
    num_speculative_tokens_per_batch_size: Any = None
    max_step_time_ratio: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or self.method not in DRAFTERS:
            raise SpecDecError(
                f"unknown speculative method {self.method!r}; choose one of {', '.join(sorted(DRAFTERS))}"
            )
        for name in ("num_speculative_tokens", "max_num_speculative_tokens"):
            k = getattr(self, name)
            if name == "num_speculative_tokens" and k == AUTO:
                continue
            if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
                extra = f" or {AUTO!r}" if name == "num_speculative_tokens" else ""
                raise SpecDecError(f"{name} must be an integer in 1..{MAX_SPECULATIVE_TOKENS}{extra}, got {k!r}")
        if self.num_speculative_tokens != AUTO and self.max_num_speculative_tokens != DEFAULT_MAX_SPECULATIVE_TOKENS:
            raise SpecDecError("max_num_speculative_tokens is the largest k num_speculative_tokens 'auto' chooses: set "
                               f"num_speculative_tokens to 'auto', or give the fixed k ({self.num_speculative_tokens}) "
                               "alone")
        if self.num_speculative_tokens_per_batch_size is not None:
            if self.num_speculative_tokens == AUTO:
                raise SpecDecError(f"{SCHEDULE} fixes k per batch size and num_speculative_tokens 'auto' chooses "
                                   "it from measured cost: give one of them (with a schedule, num_speculative_tokens "
                                   "is the most a row drafts)")
            self.num_speculative_tokens_per_batch_size = parse_schedule(self.num_speculative_tokens_per_batch_size,
                                                                        self.num_speculative_tokens)
        ratio = self.max_step_time_ratio
        if ratio is not None:
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 1 <= ratio < math.inf:
                raise SpecDecError(f"max_step_time_ratio must be a finite number >= 1 (a drafting step's time in "
                                   f"plain steps), got {ratio!r}")
            if self.num_speculative_tokens != AUTO:
                raise SpecDecError("max_step_time_ratio bounds the drafts num_speculative_tokens 'auto' chooses: set "
                                   "num_speculative_tokens to 'auto'")
        threshold = self.draft_confidence_threshold
        if threshold is not None:
            if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < 1:
                raise SpecDecError(f"draft_confidence_threshold must be a number in [0, 1), got {threshold!r}")
            if not DRAFTERS[self.method].confidence_stop:
                raise SpecDecError(f"speculative method {self.method!r} takes no draft_confidence_threshold")
        candidates = self.num_candidates
        if not isinstance(candidates, int) or isinstance(candidates, bool) or not 1 <= candidates <= MAX_CANDIDATES:
            raise SpecDecError(f"num_candidates must be an integer in 1..{MAX_CANDIDATES}, got {candidates!r}")
        if candidates > 1 and not DRAFTERS[self.method].tree_drafts:
            raise SpecDecError(f"speculative method {self.method!r} does not choose among several candidates per "
                               f"step: it takes no num_candidates > 1")
        if self.draft_vocab_size is not None:
            check_draft_vocab_size(self.draft_vocab_size)
            if not DRAFTERS[self.method].draft_vocab:
                raise SpecDecError(f"speculative method {self.method!r} takes no draft_vocab_size: it scores no "
                                   "vocabulary with an output head")
        if self.model is not None and not isinstance(self.model, (str, os.PathLike, PreTrainedModel)):
            raise SpecDecError(f"a draft 'model' is a folder, a hub id or a PreTrainedModel, got {self.model!r}")
        if self.dtype is not None and not isinstance(self.dtype, (str, torch.dtype)):
            raise SpecDecError(f"a draft 'dtype' is a name such as 'float32', got {self.dtype!r}")
        for name, kind, allowed in (("candidates", "candidate", "composite"), ("stages", "stage", "staged")):
            nested = getattr(self, name)
            if nested is None:
                continue
            if not getattr(DRAFTERS[self.method], allowed):
                raise SpecDecError(f"speculative method {self.method!r} takes no {name!r}")
            if not isinstance(nested, list):
                raise SpecDecError(f"{name!r} must be a list of speculative configs, got {nested!r}")
            configs = []
            for i, c in enumerate(nested):
                try:
                    configs.append(c if isinstance(c, SpeculativeConfig) else SpeculativeConfig.from_dict(c))
                except SpecDecError as exc:
                    raise SpecDecError(f"{self.method} {kind} {i}: {exc}") from None
            setattr(self, name, configs)
        self._check_method_fields()
        DRAFTERS[self.method].check_config(self)

    def _check_method_fields(self) -> None:
        """A field of :data:`METHOD_FIELDS` set away from its default for a method that does not read it is refused
        by name (it would change nothing), with the methods that read it."""
        kind = DRAFTERS[self.method]
        for f in fields(self):
            if f.name in METHOD_FIELDS and f.name not in kind.reads and getattr(self, f.name) != f.default:
                raise SpecDecError(f"speculative method {self.method!r} takes no {f.name!r} (it is read by "
                                   f"{', '.join(methods_reading(f.name))})")

    @property
    def max_k(self) -> int:
        """The most tokens a row drafts in a step (``max_num_speculative_tokens`` with ``"auto"``)."""
        k = self.num_speculative_tokens
        return self.max_num_speculative_tokens if k == AUTO else k

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeculativeConfig:
        """Build from a plain dict, rejecting unknown keys by name; without a ``method``, the one its ``model``
        means (:func:`specdec.drafters.method_of.method_of`, as vLLM infers it)."""
        if not isinstance(data, dict):
            raise SpecDecError(f"speculative_config must be a dict, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        for name in VLLM_NEUTRAL.keys() & data.keys():  # vLLM's keys that change nothing here, at their neutral values
            check_neutral(name, data[name], VLLM_NEUTRAL[name], f"speculative_config {name!r}")
        data = {k: v for k, v in data.items() if k not in VLLM_NEUTRAL}
        unknown = sorted(set(data) - known)
        if unknown:
            close = [f"{key!r}: {VLLM_CLOSE[key]}" for key in unknown if key in VLLM_CLOSE]
            raise SpecDecError(f"unknown speculative_config keys {unknown}; known keys are {sorted(known)}"
                               + (f" (vLLM's {'; '.join(close)})" if close else ""))
        low = data.get("prompt_lookup_min")
        if "prompt_lookup_max" not in data and isinstance(low, int) and low > cls.prompt_lookup_max:
            data = {**data, "prompt_lookup_max": low}  # a minimum alone above the default maximum: vLLM's max = min
        if "method" not in data:
            if data.get("model") is None:
                raise SpecDecError("speculative_config needs a 'method' (or a 'model' to infer it from)")
            from specdec.drafters.method_of import method_of

            data = {**data, "method": method_of(data["model"])}
        return cls(**data)


VLLM_NEUTRAL = {"draft_tensor_parallel_size": (None, 1), "quantization": (None,), "revision": (None,),
                "code_revision": (None,), "disable_by_batch_size": (None,), "speculative_token_tree": (None,),
                "acceptance_method": ("rejection_sampler",), "max_model_len": ANY, "enforce_eager": ANY,
                "disable_padded_drafter_batch": ANY}
"""vLLM's ``speculative_config`` keys that specdec does not implement, with the values that change nothing here
(``ANY``: every value; those settle only how vLLM runs its drafter, never which tokens come out: a draft's
``max_model_len``, where vLLM stops drafting, is the ``LLM``'s here, and every drafter captures graphs as the
target does, ``enforce_eager`` being the ``LLM``'s)."""

VLLM_CLOSE = {
    "suffix_decoding_max_spec_factor": "the closest here is 'suffix_factor' (drafts grow with the match's "
                                       "frequency too)",
    "suffix_decoding_min_token_prob": "the closest here is 'suffix_min_prob'",
    "suffix_decoding_max_cached_requests": "the closest here is 'suffix_cache_max_tokens', a number of tokens",
    "suffix_decoding_max_tree_depth": "here matches are measured up to specdec.drafters.suffix_index.MAX_MATCH "
                                      "tokens",
}
"""vLLM's ``speculative_config`` keys of another meaning here, and what an unknown-key error says of each."""


@dataclass
class DraftBatch:
    """One step's proposals for a batch: chains (the layout of :mod:`specdec.verify`) or trees.

    ``tokens`` ``[B, K]`` int64 on the device (row ``b`` in its first ``num_draft[b]`` columns,
    the rest padding), ``num_draft`` ``[B]`` host ints, ``probs`` ``[B, K, V]``: the distribution
    each token was sampled from, or None when the drafter is deterministic.

    ``parents`` ``[B, K]`` int64 on the device, or None for chains: the tree form of
    :mod:`specdec.tree` (``parents[b, i]`` the node index of node ``i``'s parent, -1 for the
    pending token; parents before children; siblings in the order they are to be tried). With a
    tree, ``num_draft[b]`` counts nodes (never more than the ``ks[b]`` the drafter was given) and
    ``probs[b, i]`` is the distribution node ``i`` was drawn from given its parent and its earlier
    siblings (see :func:`specdec.verify.verify_tree_stochastic`); None treats every node as
    deterministic, which is exact for top-k or lookup trees. Tree drafts need a target with
    ``supports_tree_mask``: a tree drafter checks it in ``from_config``.

    ``hidden`` ``[B, K+1, H]`` or None: a drafter that ran the target's own first layers on each
    row's ``[pending, d_1..d_n]`` (and wrote their cache entries into the target's pool) hands
    their output, the input of the layers verification still runs, ``remaining_layers``.
    """

    tokens: torch.Tensor
    num_draft: list[int]
    probs: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    remaining_layers: tuple[int, ...] | None = None
    parents: torch.Tensor | None = None

    @classmethod
    def from_lists(cls, rows: list[list[int]], device: torch.device) -> DraftBatch:
        """A deterministic batch from host token lists (ragged)."""
        width = max((len(r) for r in rows), default=0)
        padded = [r + [0] * (width - len(r)) for r in rows]
        tokens = torch.tensor(padded, dtype=torch.long).reshape(len(rows), width)
        return cls(to_device(tokens, device), [len(r) for r in rows])

    @classmethod
    def from_trees(cls, rows: list[tuple[list[int], list[int]]], device: torch.device) -> DraftBatch:
        """A deterministic tree batch from host ``(tokens, parents)`` per row (ragged; padding
        columns get token 0 and parent -1)."""
        width = max((len(tokens) for tokens, _ in rows), default=0)
        table = [tokens + [0] * (width - len(tokens)) for tokens, _ in rows]
        table += [parents + [-1] * (width - len(parents)) for _, parents in rows]
        both = to_device(torch.tensor(table, dtype=torch.long).reshape(2, len(rows), width), device)
        return cls(both[0], [len(tokens) for tokens, _ in rows], parents=both[1])


@dataclass
class LoadOptions:
    """What a drafter needs to build its state: the target's device and backend, the
    target's tokenizer (None when the target has none, used to check that they agree), the
    engine's pool size (``num_slots`` sequences of ``max_model_len`` tokens, in the blocks ``kv_budget``
    gives, :class:`~specdec.models.kv_budget.KVBudget`; None: enough for every slot to be full), whether
    pools cache prefixes (``prefix_caching``) and whether CUDA graphs are off (``enforce_eager``)."""

    device: torch.device
    backend: str
    num_slots: int
    max_model_len: int
    target_tokenizer: Any = None
    enforce_eager: bool = False
    kv_budget: KVBudget | None = None
    prefix_caching: bool = False


class Drafter(ABC):
    """Proposes draft tokens for a batch of sequences.

    The engine calls ``add`` when sequences start (the drafter absorbs their prompts), then
    every step ``propose`` and, after verification, ``observe``; ``release`` when a sequence
    finishes or is aborted. State is keyed by the sequence (its ``request_id`` or ``slot``),
    never by position in the batch. A sequence's ``token_ids`` is its committed context, the
    last token being the pending token that the target has not cached yet.
    """

    method: ClassVar[str]
    #: One line for CLI help and benchmark reports.
    description: ClassVar[str]
    #: Whether the method needs ``speculative_config["model"]`` (a draft model).
    needs_model: ClassVar[bool] = False
    #: Whether the method's ``model`` is a draft causal LM (the command line then drafts with the embedded pair's
    #: draft when it names none; a head folder is not one).
    draft_lm: ClassVar[bool] = False
    #: Whether the method takes a ``model`` (a folder) but has a default without one (trained heads).
    optional_model: ClassVar[bool] = False
    #: Whether the method honours ``draft_confidence_threshold`` (its proposals have a confidence).
    confidence_stop: ClassVar[bool] = False
    #: Whether the method proposes trees of ``num_candidates`` continuations when it is above 1.
    tree_drafts: ClassVar[bool] = False
    #: The target's hidden states the method reads (``ForwardBatch.hidden_layers`` indices, ``-1`` the
    #: final normed one); the engine then hands them over through ``observe_hidden``.
    hidden_layers: ClassVar[tuple[int, ...]] = ()
    #: Whether the method combines the drafters of ``speculative_config["candidates"]``.
    composite: ClassVar[bool] = False
    #: Whether the method chains the drafters of ``speculative_config["stages"]``.
    staged: ClassVar[bool] = False
    #: Whether the method reads the target's argmax at every fed position of its drafts; the engine then
    #: hands it over through ``observe_node_argmax``.
    wants_node_argmax: ClassVar[bool] = False
    #: Whether the method can score a reduced vocabulary from its folder's token counts (``draft_vocab_size``).
    draft_vocab: ClassVar[bool] = False
    #: The fields of :data:`METHOD_FIELDS` the method reads; another method given one of them refuses it.
    reads: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def fields_read(cls, values: dict[str, Any]) -> dict[str, Any]:
        """The entries of ``values`` (speculative_config fields) that are :data:`METHOD_FIELDS` the method reads, or
        fields of no method in particular; a front end hands a method these alone."""
        return {key: value for key, value in values.items() if key not in METHOD_FIELDS or key in cls.reads}
    #: Whether the method's chain drafts are deterministic and cost microseconds (a lookup): the auto method
    #: then asks it for a draft on every step, drafted with or not, and scores it against the emitted tokens.
    shadow_drafts: ClassVar[bool] = False

    @classmethod  # noqa: B027 - an optional hook, not abstract
    def check_config(cls, config: SpeculativeConfig) -> None:
        """Raise SpecDecError when ``config`` lacks what this method needs."""

    @classmethod
    def unavailable_without_model(cls, target: PreTrainedModel) -> str | None:
        """Why this method cannot run on ``target`` (a loaded transformers model) with no ``model`` in its
        config, or None when it can (a benchmark's default list skips such methods)."""
        return None

    @classmethod
    @abstractmethod
    def from_config(cls, config: SpeculativeConfig, target: CausalLM, options: LoadOptions) -> Drafter:
        """Build the drafter for ``target``, loading whatever it needs."""

    @abstractmethod
    def add(self, seqs: list[Sequence]) -> None:
        """Start sequences (their ``slot`` is set): absorb their prompts."""

    @abstractmethod
    def propose(self, seqs: list[Sequence], ks: list[int], sampling: SamplingBatch) -> DraftBatch:
        """Propose up to ``ks[b]`` tokens after ``seqs[b].token_ids`` for each row; ``sampling``
        holds the rows' parameters and generators."""

    @abstractmethod
    def observe(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        """Learn the step's outcome: ``num_accepted[b]`` drafts of row ``b`` were kept and
        ``token_ids`` is the new committed context. Roll back any state built on rejected drafts."""

    def observe_node_argmax(self, seqs: list[Sequence], argmax_rows: list[list[int]]) -> None:  # noqa: B027
        """With ``wants_node_argmax``, after a step with drafts, just before ``observe_paths`` and ``observe``
        with the same rows: ``argmax_rows[b]`` ``[K+1]`` is the target's argmax after each token row ``b`` fed,
        in the fed frame (column 0 after the pending token, column ``i + 1`` after draft or node ``i``;
        columns past the row's drafts are padding)."""

    def observe_paths(self, seqs: list[Sequence], paths: list[list[int]]) -> None:  # noqa: B027 - optional hook
        """After a tree step, just before ``observe`` with the same rows: ``paths[b]`` holds the node
        indices of row ``b``'s accepted path, root side first (``num_accepted[b]`` of them)."""

    def observe_hidden(self, seqs: list[Sequence], hidden: list[torch.Tensor]) -> None:  # noqa: B027 - optional hook
        """The target's ``hidden_layers`` states ``hidden[b]`` ``[n_b, len(hidden_layers), H]`` of the positions
        it has just committed for row ``b``: every prompt token but the pending one, just before ``add``;
        after a step, just before ``observe``, the step's pending token and its accepted drafts (chain
        order, or the accepted path's nodes for a tree)."""

    def release(self, seq: Sequence) -> None:  # noqa: B027 - stateless drafters keep nothing
        """Forget a finished or aborted sequence."""

    def backlog(self, seqs: list[Sequence]) -> list[int]:
        """Positions each row's next ``propose`` feeds the drafter's own model before its first draft: the
        context it has not absorbed yet, which grows on every step the row does not draft (0 for a drafter
        whose proposal costs the same however long it sat out, a lookup or a head on the last feature)."""
        return [0] * len(seqs)

    def catch_up(self, seqs: list[Sequence], ks: list[int]) -> None:  # noqa: B027 - most drafters have no backlog
        """Feed the drafter's own model what the rows about to draft (``ks[b] > 0``) have committed and it has not
        absorbed (:meth:`backlog`), but for what the proposal's own forward feeds. :meth:`propose` does it itself
        where this was not called; the engine calls it first and times it apart from the drafting: a switching
        cost, paid once after steps without drafts (and on a prompt, where the drafter starts lazily), not what a
        drafting step costs (:class:`specdec.adaptive.AdaptiveK`). A drafter whose catch-up is part of its
        proposal's one forward (an EAGLE layer feeding its buffered features) keeps this default."""

    def kv_pools(self) -> list[KVCache]:
        """The drafter's own KV pools, slot for slot the target's: the scheduler keeps each step's growth
        of every one of them within its free blocks (a drafter with no model keeps none)."""
        return []

    def bind_target_cache(self, cache: KVCache) -> None:  # noqa: B027 - most drafters keep their own state
        """The target's KV pool, given once by the engine to a drafter that runs the target's own layers."""

    def bind_metrics(self, metrics: BatchMetrics) -> None:  # noqa: B027 - most drafters report nothing extra
        """The engine's aggregate metrics, given once by the engine (a drafter may count its own figures there)."""

    def shadow(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """With ``shadow_drafts``: the chain ``propose`` would draft for each row (up to ``ks[b]`` tokens), as
        host lists, without touching the device."""
        raise NotImplementedError(f"{type(self).__name__} has no shadow drafts")

    def forget(self) -> None:  # noqa: B027 - most drafters learn nothing across requests
        """Forget what earlier requests taught (a benchmark's warm-up must not seed its measurements);
        running sequences keep their own state."""


def draft_probs(reference: torch.Tensor, rows: int, width: int, vocab: int) -> torch.Tensor:
    """Zeros ``[rows, width, vocab]`` to record the distribution each sampled draft token was drawn
    from (:attr:`DraftBatch.probs`): float64 beside float64 ``reference`` tensors, else float32."""
    dtype = torch.float64 if reference.dtype == torch.float64 else torch.float32
    return reference.new_zeros(rows, width, vocab, dtype=dtype)


def narrow_rows(keep: list[int], active: list[int], rows: SamplingBatch, *tensors: torch.Tensor
                ) -> tuple[list[int], SamplingBatch, list[torch.Tensor]]:
    """Keep the rows at positions ``keep`` of ``active`` (the batch rows still drafting): the kept
    batch rows, their sampling rows, and each of ``tensors`` ``[A, ...]`` cut to ``[len(keep), ...]``
    (all unchanged when every row is kept)."""
    if len(keep) == len(active):
        return active, rows, list(tensors)
    part = to_device(keep, tensors[0].device)
    return [active[j] for j in keep], rows.select(keep), [t[part] for t in tensors]


def draw_column(logits: torch.Tensor, rows: SamplingBatch, probs: torch.Tensor | None, index: torch.Tensor,
                column: int, tokens: torch.Tensor) -> torch.Tensor:
    """Draft column ``column`` of the rows ``index`` ``[A]`` from their ``logits`` ``[A, V]``: the argmax
    (``probs`` None, every row greedy), else a sample of each row's sampling distribution, recorded in
    ``probs`` ``[B, K, V]`` for verification. Writes ``tokens`` ``[B, K]``; returns the tokens ``[A]``.

    Rows under a constraint draw from their logits masked with the grammar state after their drafts so far,
    and that state then consumes the drawn token (:meth:`SamplingBatch.constrain_draft`): the one place a
    drafter's logits become draft tokens, so every method that draws through it proposes valid tokens only.
    Rows with penalties or biases draw from logits adjusted for their output and drafts so far, as the target's
    will be (:meth:`SamplingBatch.adjust_draft`)."""
    logits = rows.adjust_draft(rows.constrain_draft(logits))
    if probs is None:
        token = argmax(logits)
    else:
        q = rows.probs(logits)
        token = rows.sample(q, column)  # keyed (deterministic mode): the noise of the token it guesses
        probs[index, column] = q
    tokens[index, column] = token
    rows.advance_draft(token)
    return token


DRAFTERS: dict[str, type[Drafter]] = {}


def methods_reading(field: str) -> list[str]:
    """The registered methods that read ``field`` (one of :data:`METHOD_FIELDS`), sorted."""
    return sorted(name for name, drafter in DRAFTERS.items() if field in drafter.reads)


def register_drafter(cls: type[Drafter]) -> type[Drafter]:
    """Class decorator: make ``cls`` available as ``speculative_config["method"] == cls.method``."""
    DRAFTERS[cls.method] = cls
    return cls


def create_drafter(config: SpeculativeConfig, target: CausalLM, options: LoadOptions) -> Drafter:
    return DRAFTERS[config.method].from_config(config, target, options)
