"""Prompt lookup: propose the tokens that followed an earlier occurrence of the context's suffix."""

from __future__ import annotations

import torch

from specdec.drafters.base import DraftBatch, Drafter, LoadOptions, SpeculativeConfig, register_drafter
from specdec.errors import SpecDecError
from specdec.models.base import CausalLM
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence

MAX_PROMPT_LOOKUP = 32
"""The longest n-gram ngram matches: each n keeps its own table, updated for every committed token."""


class _Index:
    """One sequence's n-gram index: for every n-gram with a following token, its first and
    latest start; grows incrementally as tokens are committed."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.tables: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(min_n, max_n + 1)}
        self.min_n = min_n
        self.indexed_until = 0

    def extend(self, context: list[int]) -> None:
        """Index the n-grams that end before position ``end`` for each new ``end`` with a follower."""
        for end in range(max(self.indexed_until, self.min_n), len(context)):
            for n, table in self.tables.items():
                start = end - n
                if start < 0:
                    break
                entry = table.get(gram := tuple(context[start:end]))
                if entry is None:
                    table[gram] = [start, start]
                else:
                    entry[1] = start
        self.indexed_until = max(self.indexed_until, len(context))

    def lookup(self, context: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest matched suffix of ``context``."""
        self.extend(context)
        for n in sorted(self.tables, reverse=True):
            if len(context) <= n:
                continue
            entry = self.tables[n].get(tuple(context[-n:]))
            if entry is None:
                continue
            first, latest = entry
            start = latest if len(context) - (latest + n) >= k else first
            return context[start + n : start + n + k]
        return []


@register_drafter
class NgramDrafter(Drafter):
    """Matches the last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``)
    against the prompt and the generated text and proposes what followed the match.

    Each sequence has its own index (keyed by request id), so a lookup costs O(1) per n. The
    latest occurrence is preferred when at least k tokens follow it, else the first occurrence
    (which has the longest continuation). Deterministic: verified with a one-hot ``q``.
    """

    method = "ngram"
    description = "n-gram prompt lookup over the prompt and the generated text"

    def __init__(self, max_n: int, min_n: int, device: torch.device) -> None:
        self.max_n, self.min_n, self.device = max_n, min_n, device
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
        return cls(config.prompt_lookup_max, config.prompt_lookup_min, options.device)

    def add(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self._indexes[s.request_id] = _Index(self.min_n, self.max_n)

    def propose(self, seqs: list[Sequence], ks: list[int], sampling: SamplingBatch) -> DraftBatch:
        rows = [self._indexes[s.request_id].lookup(s.token_ids, k) if k > 0 else [] for s, k in zip(seqs, ks)]
        return DraftBatch.from_lists(rows, self.device)

    def observe(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        """Nothing to roll back: an index only ever holds committed tokens."""

    def release(self, seq: Sequence) -> None:
        self._indexes.pop(seq.request_id, None)
