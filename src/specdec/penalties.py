"""vLLM's logit adjustments of a request: ``allowed_token_ids``, ``bad_words``, ``logit_bias`` and the repetition,
frequency and presence penalties, applied to the target's logits at every verified position, exact under
speculation.

Terms: a row's *output* is the tokens it has generated (``Sequence.token_ids`` past the prompt); a column ``j`` of
a step's target logits decides the token that follows the row's output and the drafts on the *path* to column
``j`` (none for the pending token's column ``0``; ``d_1..d_j`` in a chain; node ``j - 1`` and its ancestors in a
tree, the rows of :func:`specdec.tree.ancestor_mask`). A token's *count* at column ``j`` is how often it occurs in
the output and the path together.

vLLM's order, each on the logits before it:

1. ``allowed_token_ids``: every other token at ``-inf``; ``bad_words``: a word's last token at ``-inf`` where the
   output and the path end with its other tokens (:func:`bad_word_ids`);
2. ``logit_bias``: ``bias[t]`` added to token ``t``'s logit;
3. ``repetition_penalty`` ``r``: the logit of a token that occurs in the prompt or has a count is divided by
   ``r`` where positive, multiplied by ``r`` where not;
4. ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p``: ``f * count + p * (count > 0)`` subtracted.

Column ``j``'s adjusted logits are then exactly the ones plain decoding samples from after the same output and
path, so exact verification (greedy matching or rejection sampling, which hold for any draft distribution) keeps
speculation's output equal to plain decoding's. A drafter that draws from its own logits position by position
(a draft model, an EAGLE, Medusa or MTP head, layer skip) draws from them adjusted the same way
(:class:`DraftAdjuster`; of the bad words only the one-token ones, which ban their token everywhere: a longer one
would read each draft on the host), so that it proposes what the adjusted target would; the others (n-gram,
suffix, lookahead, trees) propose as without adjustments, which costs acceptance, never exactness. ``-inf`` (a
banned stop token, a grammar's mask) stays ``-inf`` through every adjustment, so their order with
:mod:`specdec.min_tokens` and constraints does not matter.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Sequence_

import torch

from specdec.errors import SpecDecError
from specdec.models.base import to_device
from specdec.sampling import SamplingParams
from specdec.sequence import Sequence


def bad_word_ids(tokenizer, words: tuple[str, ...] | None, vocab: int) -> tuple[tuple[int, ...], ...]:
    """The token sequences ``bad_words`` bans, vLLM's: each word (leading spaces stripped) as the tokenizer
    encodes it alone, and with a space before it where that encodes to a different first token in as many tokens
    (a word inside a text). A :class:`SpecDecError` without a tokenizer or for a token outside the vocabulary."""
    if not words:
        return ()
    if tokenizer is None:
        raise SpecDecError("bad_words needs a tokenizer (this LLM has none: prompts are token ids)")
    sequences: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        inside = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences += [alone] + ([inside] if inside[:1] != alone[:1] and len(inside) == len(alone) else [])
    bad = sorted({t for ids in sequences for t in ids if not 0 <= t < vocab})
    if bad or not all(sequences):
        raise SpecDecError(f"bad_words {list(words)[:5]} encode to tokens outside the vocabulary (0..{vocab - 1}): "
                           f"{bad[:5]}")
    return tuple(dict.fromkeys(sequences))


def check_adjustments(params: SamplingParams, vocab: int, bad_words: tuple[tuple[int, ...], ...],
                      stops: set[int]) -> None:
    """A :class:`SpecDecError` where ``params``' token ids (``logit_bias``, ``allowed_token_ids``) are outside the
    vocabulary, or where no allowed token is left: every one banned by a one-token bad word (``bad_words``: the
    sequences :func:`bad_word_ids` made of ``params.bad_words``), or by ``stops`` (the request's stop tokens) below
    ``min_tokens``."""
    for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise SpecDecError(f"{name} {bad[:5]} are outside the vocabulary (0..{vocab - 1})")
    banned = {ids[0] for ids in bad_words if len(ids) == 1}
    allowed = set(params.allowed_token_ids or ())
    if allowed and banned.issuperset(allowed):
        raise SpecDecError(f"allowed_token_ids {sorted(allowed)[:5]} are all banned by bad_words: no token could be "
                           f"generated")
    if params.min_tokens and allowed and (stops | banned).issuperset(allowed):
        raise SpecDecError(f"allowed_token_ids {sorted(allowed)[:5]} are all stop tokens (or bad_words), which "
                           f"min_tokens ({params.min_tokens}) bans: no first token could be generated")


def adjusted_rows(seqs: Sequence_[Sequence]) -> list[int]:
    """The rows of ``seqs`` whose parameters adjust the target's logits (none: the step skips :func:`adjust`)."""
    return [b for b, s in enumerate(seqs) if s.params.adjusts_logits]


def _flat_index(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row index, token)`` ``[N]`` each, of every token of ``rows`` (host lists, one per row)."""
    return (to_device([r for r, tokens in enumerate(rows) for _ in tokens], device),
            to_device([t for tokens in rows for t in tokens], device))


def _token_counts(rows: list[list[int]], vocab: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[R, V]``: how often each token occurs in each of ``rows`` (host lists)."""
    counts = torch.zeros(len(rows), vocab, dtype=dtype, device=device)
    row, token = _flat_index(rows, device)
    counts.index_put_((row, token), torch.ones(len(token), dtype=dtype, device=device), accumulate=True)
    return counts


def _counts(seqs: list[Sequence], shape: tuple[int, int, int], device: torch.device, dtype: torch.dtype,
            drafts: torch.Tensor | None, num_draft: list[int] | None, ancestors: torch.Tensor | None) -> torch.Tensor:
    """``[R, C, V]``: each token's count at each column (module docstring) of the rows ``seqs``."""
    rows, columns, vocab = shape
    counts = _token_counts([s.token_ids[len(s.prompt_ids):] for s in seqs], vocab, device, dtype)[:, None].repeat(
        1, columns, 1)
    if drafts is not None and columns > 1:  # the path's drafts: fed token i (draft i - 1) on column j's path
        width = drafts.shape[1]
        fed = torch.arange(1, width + 1, device=device)
        if ancestors is None:  # a chain: d_1..d_j
            on_path = fed[None, None, :] <= torch.arange(columns, device=device)[None, :, None]
        else:
            on_path = ancestors[:, :, 1:]
        real = fed[None, :] <= to_device(num_draft, device)[:, None]  # [R, K]: padding counts nothing
        on_path = (on_path & real[:, None, :]).to(dtype)  # [R, C, K]
        index = drafts.clamp(0, vocab - 1)[:, None, :].expand(rows, columns, width)
        counts.scatter_add_(2, index, on_path)
    return counts


def _masks(rows: list[list[int]], shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """``[R, V]`` bool: the tokens of each of ``rows`` (host lists)."""
    mask = torch.zeros(shape, dtype=torch.bool, device=device)
    mask[_flat_index(rows, device)] = True
    return mask


def _prompt_masks(prompts: list[list[int]], params: list[SamplingParams], vocab: int,
                  device: torch.device) -> torch.Tensor:
    """``[R, V]`` bool: each row's prompt tokens where it has a repetition penalty (else none)."""
    return _masks([prompt if p.repetition_penalty != 1.0 else [] for prompt, p in zip(prompts, params)],
                  (len(prompts), vocab), device)


def _apply(work: torch.Tensor, params: list[SamplingParams], prompts: Callable[[], torch.Tensor],
           counts: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``work`` ``[R, C, V]``, row ``r`` adjusted by ``params[r]`` (module docstring) at every column, ``counts()``
    ``[R, C, V]`` its tokens' counts (built only for a penalty), ``prompts()`` ``[R, V]`` its prompt tokens
    (:func:`_prompt_masks`, built only for a repetition penalty)."""
    device, dtype, vocab = work.device, work.dtype, work.shape[-1]
    if any(p.allowed_token_ids for p in params):
        allowed = [list(p.allowed_token_ids) if p.allowed_token_ids else range(vocab) for p in params]
        work = work.masked_fill(~_masks(allowed, (len(params), vocab), device)[:, None], -torch.inf)
    if any(p.logit_bias for p in params):
        biases = [p.logit_bias or {} for p in params]
        bias = torch.zeros(len(params), vocab, dtype=dtype, device=device)
        bias[_flat_index([list(b) for b in biases], device)] = to_device(
            [v for b in biases for v in b.values()], device, dtype)
        work = work + bias[:, None]
    if not any(p.penalizes for p in params):
        return work
    count = counts().to(dtype)
    seen = count > 0
    if any(p.repetition_penalty != 1.0 for p in params):
        prompt = prompts()
        penalty = to_device([p.repetition_penalty for p in params], device, dtype)[:, None, None]
        repeated = (prompt[:, None] | seen) & (penalty != 1.0)
        work = torch.where(repeated, torch.where(work > 0, work / penalty, work * penalty), work)
    frequency = to_device([p.frequency_penalty for p in params], device, dtype)[:, None, None]
    presence = to_device([p.presence_penalty for p in params], device, dtype)[:, None, None]
    return work - frequency * count - presence * seen.to(dtype)


def adjust(logits: torch.Tensor, seqs: Sequence_[Sequence], rows: list[int], drafts: torch.Tensor | None = None,
           num_draft: list[int] | None = None, ancestors: torch.Tensor | None = None) -> torch.Tensor:
    """``logits`` ``[B, C, V]`` (or ``[B, V]``: the pending token's column alone) with the adjustments of the
    ``rows`` (:func:`adjusted_rows`) applied at every column; the other rows are unchanged. ``drafts`` ``[B, K]``
    (``C = K + 1``) and ``num_draft`` ``[B]``: the step's drafts, and ``ancestors`` ``[B, C, C]`` their tree's
    :func:`~specdec.tree.ancestor_mask` (None: chains). Returns a new tensor (the input is kept for what reads it
    unadjusted: logprobs are the target's raw distribution)."""
    flat = logits.dim() == 2
    scores = logits[:, None] if flat else logits
    picked = [seqs[b] for b in rows]
    params = [s.params for s in picked]
    index = to_device(rows, scores.device)
    work = scores[index]  # [R, C, V]
    # the picked rows' drafts [R, K], draft counts [R] and ancestors [R, C, C]
    paths = (None if drafts is None else drafts[index], None if num_draft is None else [num_draft[b] for b in rows],
             None if ancestors is None else ancestors[index])
    if any(s.bad_words for s in picked):
        work = _ban_bad_words(work, picked, *paths)
    out = scores.clone()
    out[index] = _apply(work, params,
                        lambda: _prompt_masks([s.prompt_ids for s in picked], params, work.shape[-1], work.device),
                        lambda: _counts(picked, tuple(work.shape), work.device, work.dtype, *paths))
    return out[:, 0] if flat else out


def _ban_bad_words(work: torch.Tensor, seqs: list[Sequence], drafts: torch.Tensor | None,
                   num_draft: list[int] | None, ancestors: torch.Tensor | None) -> torch.Tensor:
    """``work`` ``[R, C, V]`` with each row's ``bad_words`` applied at its columns: a bad word's last token at
    ``-inf`` where the output and the column's path end with the tokens before it (vLLM's rule; the output alone,
    not the prompt). Reads the drafts (and a tree's ancestors) on the host."""
    columns = work.shape[1]
    drafted = [] if drafts is None else drafts.tolist()
    paths = None if ancestors is None else ancestors[:, :, 1:].tolist()
    banned_rows, banned_columns, banned_tokens = [], [], []
    for r, s in enumerate(seqs):
        if not s.bad_words:
            continue
        longest = max(len(w) for w in s.bad_words)
        tail = s.token_ids[len(s.prompt_ids):][-longest:] if longest > 1 else []
        for j in range(min(columns, 1 + (num_draft[r] if num_draft is not None else 0))):
            if paths is None:
                path = drafted[r][:j] if j else []
            else:
                path = [t for t, on in zip(drafted[r], paths[r][j]) if on]
            context = tail + path
            for word in s.bad_words:
                before = len(word) - 1
                if before <= s.num_generated + len(path) and (not before or context[-before:] == list(word[:-1])):
                    banned_rows.append(r)
                    banned_columns.append(j)
                    banned_tokens.append(word[-1])
    if not banned_rows:
        return work
    device = work.device
    work = work.clone()
    work[tuple(to_device(ids, device) for ids in (banned_rows, banned_columns, banned_tokens))] = -torch.inf
    return work


def adjusted_position(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                      params: SamplingParams) -> torch.Tensor:
    """One position's logits ``[V]`` adjusted as plain decoding adjusts them after ``output_ids`` (the
    reference of ``specdec verify``; bad words are not applied)."""
    vocab, device = logits.shape[-1], logits.device
    return _apply(logits[None, None], [params], lambda: _prompt_masks([prompt_ids], [params], vocab, device),
                  lambda: _token_counts([output_ids], vocab, device, logits.dtype)[:, None])[0, 0]


class DraftAdjuster:
    """The adjustments of a step's drafting rows, for a drafter that draws its drafts one position at a time from
    its own logits (:func:`specdec.drafters.base.draw_column`): it draws from logits adjusted as the target's
    column for that position will be, for the output and the drafts drawn before it, so its ``q`` is closer to the
    adjusted target's and more drafts are accepted (any ``q`` is exact: verification sees the one drawn from).

    ``seqs``: the rows that adjust; :class:`~specdec.sampling.SamplingBatch` names each of its rows' index here
    (``members``, None for a row that does not adjust). The counts (``[R, V]``, on the logits' device, the output's
    at first) grow on the device as drafts are drawn: no host read. A one-token bad word's token is banned at every
    draft (a longer word's last token is banned by the target's columns only: it depends on the drafts before it)."""

    def __init__(self, seqs: list[Sequence]) -> None:
        self.seqs = seqs
        self.counts: torch.Tensor | None = None
        self.prompts: torch.Tensor | None = None  # [R, V], built at the first draft with a repetition penalty
        self.banned = [[w[0] for w in s.bad_words if len(w) == 1] for s in seqs]  # each row's one-token bad words

    def _counts(self, vocab: int, device: torch.device) -> torch.Tensor:
        if self.counts is None:
            self.counts = _token_counts([s.token_ids[len(s.prompt_ids):] for s in self.seqs], vocab, device,
                                        torch.float32)
        return self.counts

    def adjust(self, logits: torch.Tensor, members: list[int | None]) -> torch.Tensor:
        """A drafter's logits ``[A, V]`` of rows ``members``, the adjusting ones adjusted."""
        rows = [j for j, m in enumerate(members) if m is not None]
        if not rows:
            return logits
        mine = [members[j] for j in rows]
        counts = self._counts(logits.shape[-1], logits.device)
        index, own = to_device(rows, logits.device), to_device(mine, logits.device)
        out = logits.clone()
        out[index] = _apply(logits[index][:, None], [self.seqs[m].params for m in mine],
                            lambda: self._prompts(logits.shape[-1], logits.device)[own],
                            lambda: counts[own][:, None])[:, 0]
        bans = [(j, token) for j, m in zip(rows, mine) for token in self.banned[m]]
        if bans:
            out[tuple(to_device(list(ids), logits.device) for ids in zip(*bans))] = -torch.inf
        return out

    def _prompts(self, vocab: int, device: torch.device) -> torch.Tensor:
        if self.prompts is None:
            self.prompts = _prompt_masks([s.prompt_ids for s in self.seqs], [s.params for s in self.seqs], vocab,
                                         device)
        return self.prompts

    def advance(self, tokens: torch.Tensor, members: list[int | None]) -> None:
        """Count each adjusting row's drawn token (``tokens`` ``[A]``, rows ``members``)."""
        rows = [j for j, m in enumerate(members) if m is not None]
        if rows and self.counts is not None:
            own = to_device([members[j] for j in rows], tokens.device)
            self.counts.index_put_((own, tokens[to_device(rows, tokens.device)]),
                                   torch.ones(len(rows), device=tokens.device), accumulate=True)
