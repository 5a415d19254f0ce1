"""Suffix decoding: draft what followed the context's suffix in this request or in earlier ones."""

from __future__ import annotations

import torch

from specdec.drafters.base import DraftBatch, Drafter, LoadOptions, SpeculativeConfig, register_drafter
from specdec.drafters.suffix_index import Candidate, TokenIndex, propose, propose_tree
from specdec.errors import SpecDecError
from specdec.models.base import CausalLM
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence


@register_drafter
class SuffixDrafter(Drafter):
    """A suffix cache shared across requests (SuffixDecoding's idea, proposing chains).

    Two :class:`~specdec.drafters.suffix_index.TokenIndex` kinds: one per running sequence over
    its own prompt and output (keyed by request id, grown as tokens are committed), and one
    shared over the prompt and output of every finished or aborted request of this drafter,
    capped at ``suffix_cache_max_tokens`` tokens (the oldest requests are evicted first). The
    shared cache changes only in ``release``, between steps, so every row of a step reads the
    same cache whatever else runs. Each step a row proposes the most frequent continuation of
    its context's longest matched suffix (:func:`~specdec.drafters.suffix_index.propose`), up to
    its k; deterministic, verified with a one-hot ``q``. With ``num_candidates`` r > 1 a row proposes
    a tree instead: the continuations of that suffix, each node keeping its r most frequent
    children, the most frequent nodes first up to k nodes
    (:func:`~specdec.drafters.suffix_index.propose_tree`), verified as a tree (fast backend only).
    """

    method = "suffix"
    description = "suffix cache: continuations of the context's suffix in this and earlier requests"
    tree_drafts = True
    reads = frozenset({"suffix_cache_max_tokens", "suffix_factor", "suffix_min_prob"})
    shadow_drafts = True

    def __init__(self, max_tokens: int, factor: float, min_prob: float, device: torch.device,
                 num_candidates: int = 1) -> None:
        self.max_tokens, self.factor, self.min_prob, self.device = max_tokens, factor, min_prob, device
        self.num_candidates = num_candidates
        self.shared = TokenIndex()
        self._own: dict[str, TokenIndex] = {}

    @classmethod
    def check_config(cls, config: SpeculativeConfig) -> None:
        cap = config.suffix_cache_max_tokens
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise SpecDecError(f"suffix_cache_max_tokens must be an integer >= 0, got {cap!r}")
        factor = config.suffix_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise SpecDecError(f"suffix_factor must be a number > 0, got {factor!r}")
        prob = config.suffix_min_prob
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0 <= prob <= 1:
            raise SpecDecError(f"suffix_min_prob must be a number in [0, 1], got {prob!r}")
        if config.model is not None:
            raise SpecDecError("speculative method 'suffix' takes no 'model' (it drafts from earlier tokens)")

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: CausalLM, options: LoadOptions) -> SuffixDrafter:
        if config.num_candidates > 1 and not target.supports_tree_mask:
            raise SpecDecError(
                f"suffix with num_candidates > 1 proposes trees, which need the fast backend (Llama, Qwen2, "
                f"Mistral); {target.name!r} runs on transformers' forward: use num_candidates=1")
        return cls(config.suffix_cache_max_tokens, float(config.suffix_factor), float(config.suffix_min_prob),
                   options.device, config.num_candidates)

    def add(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            own = TokenIndex()
            own.extend(list(s.token_ids))
            self._own[s.request_id] = own

    def propose(self, seqs: list[Sequence], ks: list[int], sampling: SamplingBatch) -> DraftBatch:
        if self.num_candidates == 1:
            return DraftBatch.from_lists(self.shadow(seqs, ks), self.device)
        return DraftBatch.from_trees([propose_tree(found, k, self.factor, self.min_prob, self.num_candidates)
                                      if k > 0 else ([], []) for found, k in zip(self._found(seqs, ks), ks)],
                                     self.device)

    def shadow(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [propose(found, k, self.factor, self.min_prob) if k > 0 else []
                for found, k in zip(self._found(seqs, ks), ks)]

    def _found(self, seqs: list[Sequence], ks: list[int]) -> list[list[Candidate]]:
        """Each row's continuations (its own index's, then the shared cache's), once its new tokens are indexed."""
        found = []
        for s, k in zip(seqs, ks):
            own, context = self._own[s.request_id], s.token_ids
            if own.num_tokens < len(context):
                own.extend(context[own.num_tokens :])
            found.append(own.candidates(context, k) + self.shared.candidates(context, k) if k > 0 else [])
        return found

    def observe(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        """Nothing to roll back: the indexes only ever hold committed tokens."""

    def release(self, seq: Sequence) -> None:
        """Move the sequence's prompt and output into the shared cache, evicting the oldest requests
        beyond the cap (a request longer than the cap keeps its last tokens)."""
        if self._own.pop(seq.request_id, None) is None or self.max_tokens == 0:
            return
        tokens = seq.token_ids[-self.max_tokens :]
        while self.shared.docs and self.shared.num_tokens + len(tokens) > self.max_tokens:
            self.shared.evict_oldest()
        self.shared.add(list(tokens))

    def forget(self) -> None:
        """Empty the shared cache (what earlier requests taught); running sequences keep their own."""
        self.shared = TokenIndex()
