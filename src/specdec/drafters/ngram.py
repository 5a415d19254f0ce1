"""Prompt lookup: propose the tokens that followed an earlier occurrence of the context's suffix."""

from __future__ import annotations

import torch

from specdec.drafters.base import Draft, Drafter, LoadOptions, SpeculativeConfig, register_drafter
from specdec.errors import SpecDecError
from specdec.models.base import CachedLM
from specdec.sampling import SamplingParams


@register_drafter
class NgramDrafter(Drafter):
    """Matches the last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``)
    against the prompt and the generated text and proposes what followed the match.

    An index maps every n-gram that has a following token to its first and latest start, and
    grows incrementally as tokens are committed, so a lookup costs O(1) per n. The latest
    occurrence is preferred when at least k tokens follow it, else the first occurrence
    (which has the longest continuation). Deterministic: verified with a one-hot ``q``.
    """

    method = "ngram"
    deterministic = True

    def __init__(self, max_n: int, min_n: int, device: torch.device) -> None:
        self.max_n, self.min_n, self.device = max_n, min_n, device
        self._index: dict[int, dict[tuple[int, ...], list[int]]] = {}
        self._indexed_until = 0

    @classmethod
    def check_config(cls, config: SpeculativeConfig) -> None:
        lo, hi = config.prompt_lookup_min, config.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise SpecDecError(
                f"ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, got min={lo!r} max={hi!r}"
            )

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: CachedLM, options: LoadOptions) -> NgramDrafter:
        return cls(config.prompt_lookup_max, config.prompt_lookup_min, options.device)

    def begin(self, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator) -> None:
        self._index = {n: {} for n in range(self.min_n, self.max_n + 1)}
        self._indexed_until = 0

    def _extend(self, context: list[int]) -> None:
        """Index the n-grams that end before position ``end`` for each new ``end`` with a follower."""
        for end in range(max(self._indexed_until, self.min_n), len(context)):
            for n, table in self._index.items():
                start = end - n
                if start < 0:
                    break
                entry = table.get(gram := tuple(context[start:end]))
                if entry is None:
                    table[gram] = [start, start]
                else:
                    entry[1] = start
        self._indexed_until = max(self._indexed_until, len(context))

    def propose(self, context: list[int], k: int) -> Draft:
        self._extend(context)
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(context) <= n:
                continue
            entry = self._index[n].get(tuple(context[-n:]))
            if entry is None:
                continue
            first, latest = entry
            start = latest if len(context) - (latest + n) >= k else first
            follow = context[start + n : start + n + k]
            return Draft(torch.tensor([follow], dtype=torch.long, device=self.device))
        return Draft(torch.empty(1, 0, dtype=torch.long, device=self.device))

    def observe(self, context: list[int], num_accepted: int) -> None:
        """Nothing to roll back: the index only ever holds committed tokens."""
