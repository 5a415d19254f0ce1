"""Prompt lookup: propose the tokens that followed an earlier occurrence of the context's suffix
(a chain), or the different continuations of several occurrences (a tree, ``num_candidates > 1``)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from specdec.drafters.base import DraftBatch, Drafter, LoadOptions, SpeculativeConfig, register_drafter
from specdec.errors import SpecDecError
from specdec.models.base import CausalLM
from specdec.models.families import FAST_BACKEND
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence

MAX_PROMPT_LOOKUP = 32
"""The longest n-gram ngram matches: each n keeps its own table, updated for every committed token."""


SCAN_PER_CANDIDATE = 4
"""Occurrences of one n-gram looked at per wanted candidate (most recent first)."""


class _Index:
    """One sequence's n-gram index: for every n-gram with a following token, its starts in order;
    grows incrementally as tokens are committed."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.tables: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(min_n, max_n + 1)}
        self.min_n, self.max_n = min_n, max_n
        self.sizes = range(max_n, min_n - 1, -1)  # n-gram lengths, the longest first
        self.indexed_until = 0

    def extend(self, context: list[int]) -> None:
        """Index the n-grams that end before position ``end`` for each new ``end`` with a follower."""
        for end in range(max(self.indexed_until, self.min_n), len(context)):
            for n, table in self.tables.items():
                start = end - n
                if start < 0:
                    break
                table.setdefault(tuple(context[start:end]), []).append(start)
        self.indexed_until = max(self.indexed_until, len(context))

    def matches(self, tail: list[int]) -> Iterator[tuple[int, list[int]]]:
        """``(n, starts)`` for each suffix of ``tail`` found in the index, the longest first: the
        n-gram's length and where it starts in the indexed context, oldest first."""
        for n in self.sizes:
            if len(tail) >= n and (starts := self.tables[n].get(tuple(tail[-n:]))):
                yield n, starts

    def lookup(self, context: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens: what followed the latest occurrence of ``context``'s longest suffix found
        in the index; where that continuation runs into the end of the context, the lookup repeats on
        the context extended by the tokens proposed so far (a repeating pattern goes on repeating). So
        the proposal for ``k`` is a prefix of the proposal for ``k + 1``."""
        self.extend(context)
        draft: list[int] = []
        while len(draft) < k:
            n, starts = next(self.matches((context[-self.max_n :] + draft)[-self.max_n :]), (0, None))
            continuation = [] if starts is None else context[starts[-1] + n : starts[-1] + n + k - len(draft)]
            if not continuation:
                break
            draft += continuation
        return draft

    def candidates(self, context: list[int], k: int, count: int) -> list[list[int]]:
        """Up to ``count`` different continuations (``k`` tokens at most) of ``context``'s suffix, best
        first: :meth:`lookup`'s, then what followed the other occurrences of the longest matched suffix
        (the most recent first), then of shorter ones; a continuation that is the start of one already
        found adds nothing and is left out."""
        first = self.lookup(context, k)
        found = [first] if first else []
        for n, starts in self.matches(context[-self.max_n :]):
            for start in starts[::-1][: SCAN_PER_CANDIDATE * count]:
                if len(found) == count:
                    return found
                continuation = context[start + n : start + n + k]
                if not any(c[: len(continuation)] == continuation for c in found):
                    found.append(continuation)
        return found


def candidate_tree(candidates: list[list[int]], budget: int) -> tuple[list[int], list[int]]:
    """``(tokens, parents)`` of the trie of ``candidates`` (best first) in at most ``budget`` nodes:
    each other candidate keeps ``budget // (2 * count)`` tokens (at least one), the first one the rest
    (a lookup's best continuation is usually right for long); shared prefixes are one path, and
    siblings are tried in candidate order."""
    used = candidates[: max(budget, 0)]
    if not used:
        return [], []
    share = max(1, budget // (2 * len(used)))
    limits = [budget - share * (len(used) - 1)] + [share] * (len(used) - 1)
    tokens: list[int] = []
    parents: list[int] = []
    nodes: dict[tuple[int, int], int] = {}
    for continuation, limit in zip(used, limits):
        parent = -1
        for token in continuation[:limit]:
            node = nodes.get((parent, token))
            if node is None:
                node = nodes[(parent, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = node
    return tokens, parents


@register_drafter
class NgramDrafter(Drafter):
    """Matches the last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``)
    against the prompt and the generated text and proposes what followed the match.

    Each sequence has its own index (keyed by request id), so a lookup costs O(1) per n. The
    latest occurrence is followed, and where its continuation runs into the end of the context
    the lookup repeats with the proposed tokens appended (:meth:`_Index.lookup`), so a shorter
    draft is the start of a longer one. Deterministic: verified with a one-hot ``q``.

    With ``num_candidates > 1`` it proposes a tree: the trie of up to that many different
    continuations (other occurrences, then shorter n-grams) in at most ``num_speculative_tokens``
    nodes (:func:`candidate_tree`); rows with one candidate are chains in tree form.
    """

    method = "ngram"
    description = "n-gram prompt lookup over the prompt and the generated text"
    tree_drafts = True
    reads = frozenset({"prompt_lookup_max", "prompt_lookup_min"})
    shadow_drafts = True

    def __init__(self, max_n: int, min_n: int, device: torch.device, num_candidates: int = 1) -> None:
        self.max_n, self.min_n, self.device = max_n, min_n, device
        self.num_candidates = num_candidates
        self._indexes: dict[str, _Index] = {}

    @classmethod
    def check_config(cls, config: SpeculativeConfig) -> None:
        lo, hi = config.prompt_lookup_min, config.prompt_lookup_max
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (lo, hi)) or not 1 <= lo <= hi:
            raise SpecDecError(
                f"ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, got min={lo!r} max={hi!r}"
            )
        if hi > MAX_PROMPT_LOOKUP:
            raise SpecDecError(f"ngram needs prompt_lookup_max <= {MAX_PROMPT_LOOKUP}, got {hi}")
        if config.model is not None:
            raise SpecDecError("speculative method 'ngram' takes no 'model' (it looks up n-grams in the context)")

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: CausalLM, options: LoadOptions) -> NgramDrafter:
        if config.num_candidates > 1 and not target.supports_tree_mask:
            raise SpecDecError(
                f"ngram with num_candidates > 1 proposes trees, which need {FAST_BACKEND}; "
                f"{target.name!r} runs on transformers' forward: use num_candidates=1"
            )
        return cls(config.prompt_lookup_max, config.prompt_lookup_min, options.device, config.num_candidates)

    def add(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self._indexes[s.request_id] = _Index(self.min_n, self.max_n)

    def propose(self, seqs: list[Sequence], ks: list[int], sampling: SamplingBatch) -> DraftBatch:
        if self.num_candidates > 1:
            return DraftBatch.from_trees([
                candidate_tree(self._indexes[s.request_id].candidates(s.token_ids, k, self.num_candidates), k)
                if k > 0 else ([], []) for s, k in zip(seqs, ks)], self.device)
        return DraftBatch.from_lists(self.shadow(seqs, ks), self.device)

    def shadow(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [self._indexes[s.request_id].lookup(s.token_ids, k) if k > 0 else [] for s, k in zip(seqs, ks)]

    def observe(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        """Nothing to roll back: an index only ever holds committed tokens."""

    def release(self, seq: Sequence) -> None:
        self._indexes.pop(seq.request_id, None)
