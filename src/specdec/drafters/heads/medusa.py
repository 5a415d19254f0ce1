"""Medusa: ``K`` heads on the feature of the token before the pending one; head ``i`` drafts ``d_i``,
as a chain (its argmax or a sample) or, with ``num_candidates = r > 1``, as a static tree over each
head's top-``r`` tokens (:func:`default_paths`)."""

from __future__ import annotations

import heapq
from functools import cache
from pathlib import Path

import torch

from specdec.drafters.base import DraftBatch, LoadOptions, draft_probs, draw_column, register_drafter
from specdec.drafters.heads.common import HeadDrafter, HeadSpec, load_module, target_weights
from specdec.drafters.heads.modules import MedusaHeads
from specdec.drafters.heads.published import load_medusa
from specdec.models.base import CausalLM, to_device
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence
from specdec.tree import StaticTree


@cache
def default_paths(budget: int, width: int, depth: int) -> tuple[tuple[int, ...], ...]:
    """The ``budget`` best paths of ranks (Medusa's "choices") with ranks below ``width`` and at most
    ``depth`` long, best first. A path's cost is ``sum(rank_i + 1)`` (a rank-``r`` token is taken as
    ``2^-(r+1)`` likely to be right, independently per depth); ties go to the longer path (deeper
    drafts pay off more), then the lexicographically smaller. A child costs more than its parent, so
    every prefix of the list is a tree: a row with a smaller node budget uses the first paths only.
    """
    found: list[tuple[int, ...]] = []
    heap = [(r + 1, -1, (r,)) for r in range(width)] if depth > 0 else []
    heapq.heapify(heap)
    while heap and len(found) < budget:
        cost, _, path = heapq.heappop(heap)
        found.append(path)
        if len(path) < depth:
            for r in range(width):
                heapq.heappush(heap, (cost + r + 1, -len(path) - 1, (*path, r)))
    return tuple(found)


@cache
def static_tree(budget: int, width: int, depth: int) -> StaticTree:
    """The :class:`~specdec.tree.StaticTree` of :func:`default_paths`."""
    return StaticTree.from_paths(default_paths(budget, width, depth))


@register_drafter
class MedusaDrafter(HeadDrafter):
    """Chain drafts from Medusa heads: with ``f`` the target's feature of position ``L - 2`` (the token
    before the pending token ``t_{L-1}``, which the target's own head drew from ``f``), head ``i``
    proposes the token of position ``L - 1 + i``. The heads see neither the pending token nor earlier
    drafts, so a sampled draft ``d_i`` is drawn from head ``i``'s distribution alone; that is a valid
    proposal for exact chain verification (any ``q_i`` that does not look at the target's later tokens).
    A row drafts at most ``K`` tokens; a one-token prompt drafts nothing at its first step.

    With ``num_candidates = r > 1`` a row proposes a static tree instead: the first ``k`` paths of
    :func:`default_paths` (``k`` = ``num_speculative_tokens``, the node budget; depth at most ``K``),
    filled with each head's top-``r`` tokens. The tree is a deterministic function of the context, so
    greedy and sampled rows alike verify it with one-hot ``q`` (``probs`` None), which is exact."""

    method = "medusa"
    tree_drafts = True
    description = "Medusa heads on the target's last hidden state (trained folder; embedded for the default pair)"

    @classmethod
    def build(cls, target: CausalLM, spec: HeadSpec, state: dict[str, torch.Tensor], folder: Path,
              options: LoadOptions) -> MedusaDrafter:
        module = MedusaHeads(spec.hidden_size, spec.num_heads).to(target.device, target.dtype)
        return cls(target, spec, load_module(module, state, folder))

    @classmethod
    def build_published(cls, target: CausalLM, folder: Path, options: LoadOptions) -> MedusaDrafter:
        """Medusa heads in FasterDecoding's or vLLM's layout, each with its own output head."""
        module, spec = load_medusa(folder, target, target_weights(target)[1])
        return PublishedMedusaDrafter(target, spec, module)

    def head_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Every head's logits ``[A, K, V]`` from features ``[A, H]``: the blocks' outputs under the target's head."""
        return self.logits(self.module(features))

    def propose(self, seqs: list[Sequence], ks: list[int], sampling: SamplingBatch) -> DraftBatch:
        if self.num_candidates > 1:
            return self._propose_tree(seqs, ks)
        device = self.target.device
        features = [self.last_feature(s) for s in seqs]
        ks = [min(k, self.spec.num_heads) if f is not None else 0 for k, f in zip(ks, features)]
        active = [b for b, k in enumerate(ks) if k > 0]
        width = max(ks, default=0)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
        if not active:
            return DraftBatch(tokens, ks)
        rows = sampling.select(active) if len(active) < len(seqs) else sampling
        with torch.inference_mode():
            logits = self.head_logits(torch.stack([features[b] for b in active]))[:, :width]  # [A, K, V]
        index = to_device(active, device)
        probs = None
        if rows.all_greedy and not rows.shapes_drafts:
            tokens[index] = logits.argmax(-1)
        else:  # a head's column at a time: constraints and adjustments follow the drafts before it
            if not rows.all_greedy:
                probs = draft_probs(logits, len(seqs), width, logits.shape[-1])
            for i in range(width):  # a row draws only its own ks[b] tokens from its generator
                keep = [j for j, b in enumerate(active) if ks[b] > i]
                part = to_device(keep, device)
                draw_column(logits[part, i], rows.select(keep), probs, index[part], i, tokens)
        return DraftBatch(tokens, ks, probs)

    @torch.inference_mode()
    def _propose_tree(self, seqs: list[Sequence], ks: list[int]) -> DraftBatch:
        """Row ``b``'s tree: the first ``ks[b]`` paths of :func:`default_paths` over its top-``r`` tokens."""
        device, width, depth = self.target.device, self.num_candidates, self.spec.num_heads
        features = [self.last_feature(s) for s in seqs]
        trees = [static_tree(k, width, depth) if k > 0 and f is not None else None for k, f in zip(ks, features)]
        num_draft = [len(t.parents) if t is not None else 0 for t in trees]
        size = max(num_draft, default=0)
        tokens = torch.zeros(len(seqs), size, dtype=torch.long, device=device)
        parents = torch.full((len(seqs), size), -1, dtype=torch.long, device=device)
        active = [b for b, t in enumerate(trees) if t is not None]
        if not active:
            return DraftBatch(tokens, num_draft)
        logits = self.head_logits(torch.stack([features[b] for b in active]))  # [A, K, V]
        top = logits.topk(min(width, self.num_scored), dim=-1).indices  # [A, K, r]
        for n in sorted({num_draft[b] for b in active}):  # the rows with the same budget share a tree
            group = [j for j, b in enumerate(active) if num_draft[b] == n]
            rows, tree = to_device([active[j] for j in group], device), trees[active[group[0]]]
            tokens[rows, :n] = tree.tokens(top[to_device(group, device)])
            parents[rows, :n] = tree.parents_tensor(len(group), device)
        return DraftBatch(tokens, num_draft, parents=parents)


class PublishedMedusaDrafter(MedusaDrafter):
    """:class:`MedusaDrafter` over published heads (:class:`~.published.ResidualMedusa`), which score with their
    own output heads (the ``medusa`` method's drafter for such a folder; not a method of its own)."""

    def head_logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.module(features)
