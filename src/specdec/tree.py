"""Trees of draft tokens: pure functions from a parent array to what the target and the cache need.

The form (one per step, ``B`` rows, ``K`` the most nodes of a row):

- ``parents`` ``[B, K]`` int64: row ``b``'s nodes are its first ``n_b = num_draft[b]`` columns;
  ``parents[b, i]`` is the node index of node ``i``'s parent, ``-1`` when its parent is the
  pending token (the *root*, committed context's last token). Nodes are in topological order
  (``parents[b, i] < i``), and siblings are in the order the drafter wants them tried (the
  first sibling is verified first). Columns past ``n_b`` are padding (any value).
- A chain of ``n`` drafts is the tree ``parents = [-1, 0, 1, ..., n-2]``.
- The *fed* frame: the target is fed ``[pending, node_0, .., node_{n-1}]``, so node ``i`` is
  fed index ``i + 1`` and the root is fed index 0. Masks, depths and paths below are in the fed
  frame, ``[B, K+1, ...]``.

What the engine does with it: the target attends with :func:`ancestor_mask` (each node sees the
committed context, the root and its own ancestors), at positions ``L + depth``
(:func:`depths`); verification (:func:`specdec.verify.verify_tree_greedy` /
:func:`~specdec.verify.verify_tree_stochastic`) returns the accepted path as node indices; the
cache entries of that path are moved to contiguous positions (:func:`compaction_moves`), the
others dropped.

Building trees: :class:`StaticTree` (Medusa-style, a fixed list of paths of top-k choices,
filled with each row's top-k tokens per depth) and :func:`expand` + :func:`prune` (EAGLE-2-style
dynamic trees: grow the most probable nodes by cumulative draft log-probability, then keep the
best ``N`` nodes); both produce the ``(tokens, parents)`` form above.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.errors import SpecDecError


def chain_parents(num_nodes: int) -> list[int]:
    """The parent array of a chain of ``num_nodes`` drafts: ``[-1, 0, 1, ...]``."""
    return list(range(-1, num_nodes - 1))


def check_parents(parents: Sequence[int]) -> None:
    """Raise SpecDecError unless ``parents`` (one row, host ints) is a topologically ordered tree."""
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise SpecDecError(f"tree node {i} has parent {p}: a parent must be -1 (the root) or an earlier node")


def fed_parents(parents: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
    """``[B, K]`` node parents -> ``[B, K+1]`` parents in the fed frame: the root (0) and every
    padding column point to themselves, node ``i`` (fed ``i+1``) to ``parents[b, i] + 1``."""
    batch, k = parents.shape
    columns = torch.arange(k + 1, device=parents.device).expand(batch, k + 1)
    shifted = torch.cat([parents.new_full((batch, 1), -1), parents], dim=1) + 1
    real = (columns >= 1) & (columns <= num_draft[:, None])
    return torch.where(real, shifted, columns)


def ancestor_mask(parents: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
    """``[B, K+1, K+1]`` bool in the fed frame: ``mask[b, i, j]`` when fed token ``j`` is ``i`` or
    one of its ancestors (the root is everyone's ancestor; a padding column sees only itself).

    ``parents`` ``[B, K]``, ``num_draft`` ``[B]`` on the same device. This is the tree part of the
    target's attention mask (``ForwardBatch.tree_mask`` rows are the real fed tokens of it)."""
    up = fed_parents(parents, num_draft)
    size = up.shape[1]
    eye = torch.eye(size, dtype=torch.float32, device=up.device).expand(up.shape[0], size, size)
    reach = eye + torch.nn.functional.one_hot(up, size).to(torch.float32)
    for _ in range(max(1, (size - 1).bit_length())):  # path doubling: reach 2^t steps up
        reach = torch.bmm(reach, reach).clamp_max_(1.0)
    return reach > 0


def depths(mask: torch.Tensor) -> torch.Tensor:
    """``[B, K+1]`` depth of each fed token (root 0) from its :func:`ancestor_mask` ``[B, K+1, K+1]``;
    the target's position of fed token ``i`` is the slot's cached length plus ``depth[b, i]``."""
    return mask.sum(-1) - 1


def root_to_leaf_paths(parents: Sequence[int]) -> list[list[int]]:
    """The node indices of every root-to-leaf path of one tree (host ints), leaves in index order,
    each path root side first. An empty tree has no paths."""
    check_parents(parents)
    has_child = set(p for p in parents if p >= 0)
    paths = []
    for leaf in range(len(parents)):
        if leaf in has_child:
            continue
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = parents[node]
        paths.append(path[::-1])
    return paths


def compaction_moves(
    slots: Sequence[int], starts: Sequence[int], paths: Sequence[Sequence[int]]
) -> tuple[list[int], list[int], list[int]]:
    """The cache moves that make each row's accepted path contiguous after a tree step.

    Row ``b`` fed ``[pending, nodes]`` into slot ``slots[b]`` from cache index ``starts[b]`` (fed
    token ``j`` at ``starts[b] + j``); ``paths[b]`` holds the accepted node indices, root side first
    (increasing). The entries of the path must end at ``starts[b] + 1 + t`` for its ``t``-th node.
    Returns ``(slot, source, destination)`` lists, one entry per moved token (entries already in
    place are left out), for :meth:`~specdec.models.base.KVCache.compact`. Afterwards the slot's
    length is ``starts[b] + 1 + len(paths[b])``.
    """
    move_slots, sources, targets = [], [], []
    for slot, start, path in zip(slots, starts, paths):
        for t, node in enumerate(path):
            if node != t:
                move_slots.append(slot)
                sources.append(start + 1 + node)
                targets.append(start + 1 + t)
    return move_slots, sources, targets


# ---------------------------------------------------------------------- static trees (Medusa-style)
@dataclass(frozen=True)
class StaticTree:
    """A fixed tree shape given as paths of top-k choices (Medusa's "choices").

    ``(0, 1)`` is the node reached by the top-1 token at depth 1, then the second-best token at
    depth 2. ``parents``, ``depth`` (1 for the root's children) and ``rank`` are per node, ``[T]``
    host ints, in topological order (by depth, then by path): the form of this module.
    """

    parents: tuple[int, ...]
    depth: tuple[int, ...]
    rank: tuple[int, ...]

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> StaticTree:
        """Build from paths; every prefix of a path must be a path too (no duplicates, ranks >= 0)."""
        keys = [tuple(p) for p in paths]
        if len(set(keys)) != len(keys):
            raise SpecDecError("a static tree lists the same path twice")
        if any(not p or any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in p) for p in keys):
            raise SpecDecError("a static tree's paths are non-empty lists of ranks >= 0")
        known = set(keys)
        for p in keys:
            if len(p) > 1 and p[:-1] not in known:
                raise SpecDecError(f"static tree path {list(p)} has no parent path {list(p[:-1])}")
        ordered = sorted(keys, key=lambda p: (len(p), p))
        index = {p: i for i, p in enumerate(ordered)}
        return cls(
            parents=tuple(index[p[:-1]] if len(p) > 1 else -1 for p in ordered),
            depth=tuple(len(p) for p in ordered),
            rank=tuple(p[-1] for p in ordered),
        )

    @property
    def max_depth(self) -> int:
        return max(self.depth, default=0)

    @property
    def max_rank(self) -> int:
        """The most top-k candidates any depth needs (``1 + max(rank)``)."""
        return 1 + max(self.rank, default=-1)

    def tokens(self, topk_tokens: torch.Tensor) -> torch.Tensor:
        """The tree's tokens ``[B, T]`` from each row's top-k tokens per depth ``[B, D, R]``
        (``topk_tokens[b, d, r]``: the ``r``-th best token at depth ``d + 1``)."""
        depth = torch.tensor(self.depth, device=topk_tokens.device) - 1
        rank = torch.tensor(self.rank, device=topk_tokens.device)
        return topk_tokens[:, depth, rank]

    def parents_tensor(self, batch: int, device: torch.device) -> torch.Tensor:
        """``[B, T]`` int64 parents, the same tree for every row."""
        return torch.tensor(self.parents, dtype=torch.long, device=device).expand(batch, -1).contiguous()


# ---------------------------------------------------------------------- dynamic trees (EAGLE-2-style)
@dataclass
class DynamicTree:
    """A pool of candidate nodes grown level by level, ``M`` nodes per row so far.

    ``tokens`` ``[B, M]`` int64, ``parents`` ``[B, M]`` int64 (-1: the root), ``scores`` ``[B, M]``
    float: the cumulative draft log-probability of the node's path (its value as a draft: an
    estimate of the log-probability that the target accepts it). Nodes are in creation order,
    hence topological.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor

    @classmethod
    def empty(cls, batch: int, device: torch.device, dtype: torch.dtype = torch.float32) -> DynamicTree:
        long = torch.empty(batch, 0, dtype=torch.long, device=device)
        return cls(long, long.clone(), torch.empty(batch, 0, dtype=dtype, device=device))


def expand(
    tree: DynamicTree, frontier: torch.Tensor, logprobs: torch.Tensor, top_k: int, width: int
) -> tuple[DynamicTree, torch.Tensor]:
    """One EAGLE-2 expansion: each frontier node gets its ``top_k`` most probable children.

    ``frontier`` ``[B, F]`` node indices (-1: the root, score 0), ``logprobs`` ``[B, F, V]``: the
    drafter's log-distribution after each frontier node. Appends ``F * top_k`` nodes (frontier
    order, then probability order) whose scores are the parent's score plus the child's
    log-probability. Returns the grown tree and the next frontier ``[B, width]``: the ``width``
    best new nodes by score (ties: the earlier node).
    """
    batch, frontier_size = frontier.shape
    top_logprobs, top_tokens = logprobs.topk(top_k, dim=-1)  # [B, F, k]
    root_score = tree.scores.new_zeros(batch, 1)
    parent_scores = torch.cat([root_score, tree.scores], dim=1).gather(1, frontier + 1)  # [B, F]
    scores = (parent_scores[:, :, None] + top_logprobs.to(tree.scores.dtype)).reshape(batch, -1)
    parents = frontier[:, :, None].expand(batch, frontier_size, top_k).reshape(batch, -1)
    first_new = tree.tokens.shape[1]
    grown = DynamicTree(
        torch.cat([tree.tokens, top_tokens.reshape(batch, -1)], dim=1),
        torch.cat([tree.parents, parents], dim=1),
        torch.cat([tree.scores, scores], dim=1),
    )
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :width]
    return grown, first_new + order


def prune(tree: DynamicTree, budgets: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """EAGLE-2's rerank: keep each row's ``budgets[b]`` best nodes by score, in topological order.

    A child's score never exceeds its parent's (log-probabilities are <= 0) and ties go to the
    earlier node, so the kept nodes form a tree. Returns ``tokens`` ``[B, N]``, ``parents``
    ``[B, N]`` (re-indexed; padding columns hold token 0 and parent -1) and ``num_draft`` ``[B]``
    host ints, ``N = max(budgets)`` capped by the pool size.
    """
    batch, size = tree.tokens.shape
    num_draft = [min(n, size) for n in budgets]
    width = max(num_draft, default=0)
    device = tree.tokens.device
    best = torch.sort(tree.scores, dim=1, descending=True, stable=True).indices[:, :width]
    columns = torch.arange(width, device=device)
    counts = torch.tensor(num_draft, device=device)
    kept = columns[None, :] < counts[:, None]
    # Kept nodes back in creation order; the others sort past them.
    best = torch.where(kept, best, size).sort(dim=1).values
    safe = best.clamp(max=max(size - 1, 0))
    new_index = torch.full((batch, size + 1), -1, dtype=torch.long, device=device)
    new_index.scatter_(1, best, columns.expand(batch, width).contiguous())
    old_parents = tree.parents.gather(1, safe)
    parents = torch.where(old_parents >= 0, new_index.gather(1, old_parents.clamp_min(0)), -1)
    tokens = tree.tokens.gather(1, safe)
    return tokens.masked_fill(~kept, 0), parents.masked_fill(~kept, -1), num_draft
