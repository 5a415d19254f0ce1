"""One constrained sequence's grammar state, and the token masks of a step.

Exactness (with respect to the *constrained target*: the target's distribution with the tokens its
constraint forbids removed and renormalised, at every position):

- the target's logits at every verified position are masked with the grammar state after the tokens
  before it (:func:`step_masks`), so ``p`` is the constrained target's distribution;
- a drafter that draws through :func:`specdec.drafters.base.draw_column` masks its logits the same way
  as it drafts (:meth:`GrammarState.draft_matcher`, advanced over each drafted token), so it proposes
  valid tokens only and its recorded ``q`` is the masked one;
- every draft is checked token by token (:func:`step_masks`) and cut at its first invalid token. A
  deterministic draft (no ``q``, or a greedy row) is cut *before* it: with a one-hot ``q`` an invalid token
  is never accepted and its residual is ``p`` itself, so the cut changes no outcome. A sampled draft whose
  ``q`` was not masked keeps the invalid token, which verification rejects with the residual
  ``norm(max(p - q, 0))`` (cutting before it would draw from ``p`` instead, which is not exact), and is cut
  after it. Tree nodes under an invalid node are never reached, so trees are not cut;
- the sequence's matcher consumes only committed tokens (:meth:`GrammarState.commit`): drafting and mask
  building work on copies, so rejected tokens never touch it (nothing to roll back).

Masks are llguidance bitmasks (int32, 32 tokens a word) built on the host in one call per step for the
whole batch, then applied on the logits' device (:func:`apply_bitmask`).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from specdec.structured.grammar import clean_message, llguidance


class GrammarEngineError(RuntimeError):
    """llguidance failed on a constraint while its output was being generated (past a resource limit the
    compile-time probe did not reach): the step fails, so the caller sees it instead of a broken output."""


@cache
def _executor() -> Any:
    return llguidance().LLExecutor()


def _fill(entries: list[tuple], bitmask: torch.Tensor) -> None:
    """Write the masks of ``entries`` (``(matcher, row)``, or ``(matcher, row, drafts)`` for a row's mask
    and the masks after each of its drafts, in the rows after it) into ``bitmask`` ``[N, W]`` (host, int32,
    contiguous), in parallel, through llguidance's executor (``llguidance.torch`` does the same, but
    importing it imports ``torch.compile``'s machinery, seconds)."""
    if not entries:
        return
    rows, words = bitmask.shape
    if len(entries[0]) == 3:
        _executor().unsafe_compute_mask_ptr_with_draft_token(entries, bitmask.data_ptr(), words * 4, rows)
    else:
        _executor().unsafe_compute_mask_ptr(entries, bitmask.data_ptr(), words * 4, rows)


class GrammarState:
    """The grammar of one sequence: ``matcher`` (an llguidance ``LLMatcher``) has consumed exactly its
    committed output tokens; during a step's drafting a copy follows the drafted tokens."""

    def __init__(self, matcher: Any, eos_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.eos_ids = eos_ids
        self._draft: Any = None
        self._draft_broken = False

    def commit(self, tokens: list[int]) -> None:
        """Advance over the step's committed tokens (once the grammar is complete only end-of-sequence
        tokens can be emitted, and there is nothing more to consume).

        A matcher in llguidance's error state (a resource limit hit while computing a mask, after which the mask
        allows only end-of-sequence) is a :class:`GrammarEngineError` here, never an output that ends with
        ``"stop"`` while its constraint is broken or incomplete."""
        for token in tokens:
            if self.matcher.is_error():
                raise GrammarEngineError(f"structured output: the grammar engine failed while generating this "
                                         f"constraint's output: {clean_message(self.matcher.get_error())}")
            if self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(token):
                raise GrammarEngineError(f"structured output: the grammar engine failed at committed token {token}: "
                                         f"{clean_message(self.matcher.get_error())}")

    def draft_matcher(self) -> Any:
        """The state after the tokens drafted so far this step (a copy of ``matcher``), or None after a drafted
        token the grammar refused (the row's later draft tokens are then drawn unmasked)."""
        if self._draft is None and not self._draft_broken:
            self._draft = self.matcher.deep_copy()
        return self._draft

    def draft_advance(self, token: int) -> None:
        draft = self._draft
        if draft is None or draft.is_stopped():
            return
        if draft.try_consume_tokens([token]) != 1:
            self._draft, self._draft_broken = None, True

    def end_draft(self) -> None:
        """Forget the step's draft state (called by the engine after proposing)."""
        self._draft, self._draft_broken = None, False


def new_bitmask(rows: int, vocab: int) -> torch.Tensor:
    """``[rows, ceil(vocab / 32)]`` int32 on the host, every token allowed."""
    return torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)


@cache
def _byte_bits(device: torch.device) -> torch.Tensor:
    """``[256, 8]`` bool: the bits of each byte value, least significant first."""
    return ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool().to(device)


def allowed_tokens(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """``bitmask`` ``[..., W]`` int32 (token ``t`` is bit ``t % 32`` of word ``t // 32``) as bool ``[..., vocab]``
    on ``device``: its bytes (little-endian words) looked up in a table of their bits."""
    data = bitmask.to(device, non_blocking=True).contiguous().view(torch.uint8).long()
    return _byte_bits(device)[data].flatten(-2)[..., :vocab]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[..., V]`` with the tokens whose bit is 0 in ``bitmask`` ``[..., W]`` (same leading
    shape, host or device) set to ``-inf``; a new tensor."""
    return logits.masked_fill(~allowed_tokens(bitmask, logits.shape[-1], logits.device), float("-inf"))


def constrain_draft(logits: torch.Tensor, grammars: list[GrammarState | None]) -> torch.Tensor:
    """A drafter's logits ``[A, V]`` of rows ``grammars`` masked with each constrained row's draft state. A
    row that would have no token left (its valid tokens all outside a reduced draft vocabulary) gets a
    uniform distribution over the valid tokens instead: any ``q`` is exact as long as verification sees it."""
    entries = [(m, r) for r, g in enumerate(grammars) if g is not None and (m := g.draft_matcher()) is not None]
    if not entries:
        return logits
    bitmask = new_bitmask(logits.shape[0], logits.shape[-1])
    _fill(entries, bitmask)
    allowed = allowed_tokens(bitmask, logits.shape[-1], logits.device)
    masked = logits.masked_fill(~allowed, float("-inf"))
    dead = torch.isneginf(masked).all(-1, keepdim=True)
    if not dead.any():  # a host read, as the draft tokens' own (advance_draft) that follows
        return masked
    return torch.where(dead, torch.zeros_like(logits).masked_fill(~allowed, float("-inf")), masked)


def advance_draft(tokens: torch.Tensor, grammars: list[GrammarState | None]) -> None:
    """Each constrained row's draft state consumes its drawn token (``tokens`` ``[A]``; one host read)."""
    for g, token in zip(grammars, tokens.tolist()):
        if g is not None:
            g.draft_advance(token)


def step_masks(grammars: list[GrammarState | None], draft_tokens: list[list[int]], num_draft: list[int],
               parents: list[list[int]] | None, keep_invalid: list[bool], vocab: int
               ) -> tuple[list[int], torch.Tensor]:
    """The target's masks for one step and the cut of each chain.

    ``draft_tokens`` ``[B][K]`` host lists, ``num_draft`` ``[B]``, ``parents`` ``[B][K]`` or None (chains),
    ``keep_invalid[b]``: row ``b``'s draft was sampled from a recorded ``q`` (keep its first invalid token,
    see the module docstring). Returns ``(num_draft after the cut [B], bitmask [B, K+1, W])``: column ``j``
    of row ``b`` is the mask after the pending token and the first ``j`` drafts (trees: after node ``j - 1``'s
    path), every token allowed for rows without a constraint and past a row's first invalid token.
    """
    width = len(draft_tokens[0]) if draft_tokens else 0
    bitmask = new_bitmask(len(grammars) * (width + 1), vocab)
    if parents is None:
        # The drafts up to the first end-of-sequence token: llguidance advances over each, writes each
        # position's mask, stops at the first invalid one and rolls the matcher back.
        # (Rows without drafts take the plain call: at most two calls a step.)
        entries, roots, eos_at = [], [], []
        for b, g in enumerate(grammars):
            if g is None:
                continue
            chain = draft_tokens[b][: num_draft[b]]
            end = next((j for j, t in enumerate(chain) if t in g.eos_ids), None)
            if chain:
                entries.append((g.matcher, b * (width + 1), chain if end is None else chain[: end + 1]))
            else:
                roots.append((g.matcher, b * (width + 1)))
            eos_at.append((b, end))
        _fill(entries, bitmask)
        _fill(roots, bitmask)
        bitmask = bitmask.view(len(grammars), width + 1, -1)
        for b, end in eos_at:  # after an end-of-sequence token only more of it may follow
            if end is not None:
                bitmask[b, end + 1 :] = _only(grammars[b].eos_ids, bitmask.shape[-1])
        if width == 0:
            return list(num_draft), bitmask
        cut = _valid_prefix(bitmask, draft_tokens, num_draft)  # n itself for a row without a constraint
        return [min(n, c + 1) if keep else c for n, c, keep in zip(num_draft, cut, keep_invalid)], bitmask
    entries = []
    for b, g in enumerate(grammars):
        if g is None:
            continue
        states = {-1: g.matcher}
        entries.append((g.matcher, b * (width + 1)))
        for i in range(num_draft[b]):
            parent = states.get(parents[b][i])
            if parent is None:  # under an invalid node: never reached
                continue
            token = draft_tokens[b][i]
            if parent.is_stopped():
                if token not in g.eos_ids:
                    continue
                state = parent
            else:
                state = parent.deep_copy()
                if state.try_consume_tokens([token]) != 1:
                    continue
            states[i] = state
            entries.append((state, b * (width + 1) + i + 1))
    _fill(entries, bitmask)
    return list(num_draft), bitmask.view(len(grammars), width + 1, -1)


def _only(tokens: frozenset[int], words: int) -> torch.Tensor:
    """A ``[W]`` bitmask allowing exactly ``tokens``."""
    mask = torch.zeros(words, dtype=torch.int64)
    for t in tokens:
        mask[t // 32] |= 1 << (t % 32)
    return torch.where(mask >= 2**31, mask - 2**32, mask).to(torch.int32)


def _valid_prefix(bitmask: torch.Tensor, draft_tokens: list[list[int]], num_draft: list[int]) -> list[int]:
    """How many of each row's first drafts are allowed by the mask before them (``bitmask`` ``[B, K+1, W]``)."""
    tokens = torch.tensor(draft_tokens, dtype=torch.int64).view(len(num_draft), -1)
    words = bitmask[:, :-1].long().gather(-1, (tokens // 32)[..., None]).squeeze(-1)
    allowed = ((words >> (tokens % 32)) & 1).bool()
    columns = torch.arange(tokens.shape[1])
    allowed &= columns[None, :] < torch.tensor(num_draft)[:, None]
    return allowed.long().cumprod(1).sum(1).tolist()
