"""Verification of chain drafts for a whole batch: pure tensor functions, no models, no caches.

Vocabulary (one step; ``B`` sequences, ``K`` the longest draft of the step):

- ``draft_tokens`` ``[B, K]``: row ``b`` proposed ``d_1..d_{n_b}`` in its first ``n_b =
  num_draft[b]`` columns (ragged: ``n_b`` may be anything from 0 to ``K``); later columns
  are padding and never accepted.
- ``draft_probs`` ``q`` ``[B, K, V]``: the distribution each draft token was sampled from,
  or None for a deterministic drafter (n-gram lookup), verified as if ``q`` were one-hot on
  its token. A greedy row's ``q`` is one-hot too.
- ``target_probs`` ``p`` ``[B, K+1, V]``: the target's distribution after the pending token
  and after each draft token; column ``i`` scores ``d_{i+1}``, column ``n_b`` follows the
  last draft.
- accepted: ``d_i`` is kept when ``u_i * q_i(d_i) < p_i(d_i)``, ``u_i`` uniform in [0, 1),
  i.e. with probability ``min(1, p_i(d_i) / q_i(d_i))``; verification stops at the first
  rejection. ``num_accepted`` ``[B]`` counts the kept prefix (at most ``n_b``).
- recovered token: at the first rejection ``n``, a token drawn from the residual
  ``norm(max(p_n - q_n, 0))``.
- bonus token: when all ``n_b`` drafts are accepted, a token drawn from ``p_{n_b}``.

Each row emits ``num_accepted + 1`` tokens, distributed exactly as the target would have
sampled them one at a time (Leviathan et al. 2023; Chen et al. 2023). The random numbers are
inputs (``uniforms``, and ``noise`` for the exponential race ``argmax(p / E)``), drawn by the
caller from each row's own generator, so these functions stay pure and batch-invariant. A
greedy row (``p`` one-hot, ``u = 0``, ``E = 1``) keeps the longest prefix equal to the
target's argmax and emits the argmax after it: exactly greedy verification.

:func:`verify_stochastic` returns ``(output_tokens [B, K+1], num_accepted [B])``;
``output_tokens[b, :n+1]`` are the emitted tokens and the positions after them hold ``-1``.
All-greedy chain batches are matched on the host instead (:func:`greedy_accepted`, one row at a
time after the step's single device read): the same result, without a dozen small tensor ops.

Trees (the form of :mod:`specdec.tree`: ``parents`` ``[B, K]``, -1 for the root). Column ``i+1``
of ``target_probs`` is the target's distribution after node ``i``'s path, column 0 after the
pending token. Verification walks down from the root; at the current node ``c`` with target
distribution ``r = p_c`` it tries ``c``'s children ``x_1..x_m`` in index order (SpecInfer's
multi-step speculative sampling; recursive rejection sampling when siblings are drawn without
replacement):

- ``x_j`` is accepted when ``u_j * q_j(x_j) < r(x_j)``; verification moves to ``x_j`` with
  ``r = p_{x_j}``;
- else ``r <- norm(max(r - q_j, 0))`` and the next sibling is tried;
- when no child is accepted (or ``c`` is a leaf), one token is drawn from ``r``.

``q_j`` is the distribution ``x_j`` was drawn from *given the siblings before it* (``probs[b, j]``:
the same ``q`` for i.i.d. siblings, ``q`` without the earlier siblings, renormalised, for
sampling without replacement) or, when the drafter is deterministic (``probs`` None), one-hot on
``x_j``. Why this is lossless: at a node, before trying ``x_j``, assume the emitted token must be
distributed as ``r``. Given everything before it, ``x_j ~ q_j``, so the token is ``t = x_j`` and
accepted with probability ``min(r(t), q_j(t))``; a rejection happens with probability ``1 -
sum(min(r, q_j)) = sum(max(r - q_j, 0))``, and the next residual does not depend on which ``x_j``
was rejected, so (by induction over the remaining siblings, the last step drawing from ``r``
itself) the token emitted after a rejection is distributed as ``norm(max(r - q_j, 0))``. Both
together give ``min(r, q_j) + max(r - q_j, 0) = r``. At the root ``r = p``: the first emitted
token is distributed as the target's; given it was an accepted child, the same argument holds one
level down with that child's ``p`` (its subtree was drafted from that context alone, and the
uniforms are fresh). A deterministic child's one-hot ``q`` makes its test "accept with
probability ``r(x_j)``" and its residual "``r`` without ``x_j``", i.e. the exact conditional
distribution given that ``x_j`` was not emitted (a repeated sibling is then never accepted). A
greedy row is the case ``r`` one-hot, ``u = 0``, ``E = 1``.

Tree functions return ``(output_tokens [B, K+1], num_accepted [B], path [B, K])``: ``path[b,
:num_accepted[b]]`` are the accepted node indices, root side first (-1 after them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdec.argmax import argmax
from specdec.models.base import to_device

if TYPE_CHECKING:
    from specdec.sampling import SamplingBatch


def _pad_after(tokens: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    return tokens.masked_fill(positions[None, :] > num_accepted[:, None], -1)


def _num_accepted(accept: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row of ``accept`` ``[B, K]``, within its ``num_draft``."""
    columns = torch.arange(accept.shape[1], device=accept.device)
    accept = accept & (columns[None, :] < num_draft[:, None])
    return accept.to(torch.int64).cumprod(dim=1).sum(dim=1)


def greedy_accepted(target_tokens: list[int], draft_tokens: list[int], num_draft: int) -> int:
    """Greedy verification of one chain row on host lists (after the step's device read): how many
    of the first ``num_draft`` drafts equal the target's argmax ``target_tokens`` ``[K+1]`` (the
    argmax after the pending token and after each draft) before the first that does not. The
    row then emits ``target_tokens[: count + 1]``: the accepted drafts and the argmax after them."""
    count = 0
    while count < num_draft and draft_tokens[count] == target_tokens[count]:
        count += 1
    return count


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(p - q, 0))`` over the last dimension; falls back to ``p`` where it is all zero."""
    residual = (p - q).clamp_min_(0)
    total = residual.sum(-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp_min(torch.finfo(p.dtype).tiny), p)


def verify_stochastic(
    draft_tokens: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact rejection sampling of ragged chain drafts (see the module docstring).

    ``draft_tokens`` ``[B, K]``, ``num_draft`` ``[B]``, ``draft_probs`` ``[B, K, V]`` or None,
    ``target_probs`` ``[B, K+1, V]``, ``uniforms`` ``[B, K]`` in [0, 1), ``noise`` ``[B, V]``
    positive (exponential for sampled rows, ones for greedy rows).
    """
    batch, k = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    p_draft = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    num_accepted = _num_accepted(uniforms.to(p_draft.dtype) * q_draft < p_draft, num_draft)

    # The distribution of the one token emitted after the accepted prefix: the residual at a
    # rejection, p itself after a fully accepted draft (computed for every row: no host sync).
    p_next = target_probs[rows, num_accepted]
    rejected = num_accepted < num_draft
    if k:
        at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_next = torch.nn.functional.one_hot(draft_tokens[rows, at], p_next.shape[-1]).to(p_next.dtype)
        else:
            q_next = draft_probs[rows, at].to(p_next.dtype)
        p_next = torch.where(rejected[:, None], residual_distribution(p_next, q_next), p_next)
    next_token = argmax(p_next / noise.to(p_next.dtype))

    output = torch.cat([draft_tokens, draft_tokens.new_full((batch, 1), -1)], dim=1)
    output[rows, num_accepted] = next_token
    return _pad_after(output, num_accepted), num_accepted


def _tree_columns(parents: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
    """``[B, K]`` fed index of each node's parent (0 the root), -1 for padding columns."""
    columns = torch.arange(parents.shape[1], device=parents.device)
    return torch.where(columns[None, :] < num_draft[:, None], parents + 1, -1)


def verify_tree_greedy(
    draft_tokens: torch.Tensor, parents: torch.Tensor, num_draft: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy tree verification: the longest root-to-node path whose every token is the target's
    argmax after its parent, then the argmax after its last node (see the module docstring).

    ``draft_tokens`` and ``parents`` ``[B, K]``, ``num_draft`` ``[B]``, ``target_logits``
    ``[B, K+1, V]`` (fed frame: column ``i+1`` follows node ``i``). Among equally long paths
    (only possible with repeated sibling tokens, which emit the same tokens) the first is kept.
    """
    from specdec.tree import ancestor_mask

    batch, k = draft_tokens.shape
    target_tokens = argmax(target_logits)  # [B, K+1]
    up = _tree_columns(parents, num_draft)
    match = (up >= 0) & (draft_tokens == target_tokens.gather(1, up.clamp_min(0)))
    mask = ancestor_mask(parents, num_draft)[:, 1:, 1:]  # [B, K, K] node -> ancestors-or-self
    good = match & ~(mask & ~match[:, None, :]).any(-1)
    depth = mask.sum(-1)
    # Deepest good node first, then the earliest; column 0 (score 0) stands for the root alone.
    score = torch.where(good, depth * (k + 1) + (k - torch.arange(k, device=parents.device)), 0)
    best = torch.cat([score.new_zeros(batch, 1), score], dim=1).argmax(dim=1)  # fed index
    num_accepted = torch.cat([depth.new_zeros(batch, 1), depth], dim=1).gather(1, best[:, None]).squeeze(1)
    return _tree_outputs(draft_tokens, target_tokens, mask, (best - 1).clamp_min(0), num_accepted)


def _tree_outputs(
    draft_tokens: torch.Tensor, target_tokens: torch.Tensor, mask: torch.Tensor, last: torch.Tensor,
    num_accepted: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Outputs from the accepted path ending at node ``last`` ``[B]`` (ignored where ``num_accepted`` is
    0); ``target_tokens`` ``[B, K+1]`` holds the token emitted after each fed column."""
    batch, k = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    path = torch.full((batch, k), -1, dtype=torch.long, device=draft_tokens.device)
    if k:
        on_path = mask[rows, last] & (num_accepted[:, None] > 0)  # [B, K]: ancestors-or-self of the last node
        order = torch.where(on_path, torch.arange(k, device=draft_tokens.device), k).sort(dim=1).values
        path = torch.where(order < k, order, -1)
    output = torch.cat([draft_tokens.gather(1, path.clamp_min(0)), draft_tokens.new_full((batch, 1), -1)], dim=1)
    end = torch.where(num_accepted > 0, last + 1, 0)
    output[rows, num_accepted] = target_tokens[rows, end]
    return _pad_after(output, num_accepted), num_accepted, path


def sibling_residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution to try the next sibling against after one with ``q`` was rejected under ``r``:
    ``norm(max(r - q, 0))`` (``[B, V]``)."""
    return residual_distribution(r, q)


def verify_tree_stochastic(
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact multi-draft rejection sampling of ragged trees (see the module docstring).

    ``draft_tokens``, ``parents`` ``[B, K]``, ``num_draft`` ``[B]``, ``draft_probs`` ``[B, K, V]``
    or None (deterministic nodes), ``target_probs`` ``[B, K+1, V]`` (fed frame), ``uniforms``
    ``[B, K]`` in [0, 1) (one per node), ``noise`` ``[B, V]`` positive (as in
    :func:`verify_stochastic`). One pass over the nodes in index order: node ``i`` is tried when its
    parent is the current node (children come after their parent, siblings in index order).
    """
    from specdec.tree import ancestor_mask

    batch, k = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    up = _tree_columns(parents, num_draft)
    current = torch.zeros(batch, dtype=torch.long, device=draft_tokens.device)  # fed index
    r = target_probs[:, 0]
    num_accepted = torch.zeros_like(current)
    vocab = target_probs.shape[-1]
    for i in range(k):
        token = draft_tokens[:, i]
        tried = up[:, i] == current
        if draft_probs is None:
            q = torch.nn.functional.one_hot(token, vocab).to(r.dtype)
        else:
            q = draft_probs[:, i].to(r.dtype)
        accept = tried & (uniforms[:, i].to(r.dtype) * q[rows, token] < r[rows, token])
        rejected = tried & ~accept
        r = torch.where(accept[:, None], target_probs[:, i + 1],
                        torch.where(rejected[:, None], sibling_residual(r, q), r))
        current = torch.where(accept, i + 1, current)
        num_accepted += accept.to(torch.long)
    next_token = argmax(r / noise.to(r.dtype))
    mask = ancestor_mask(parents, num_draft)[:, 1:, 1:]
    emitted = torch.zeros(batch, k + 1, dtype=torch.long, device=draft_tokens.device)
    emitted[rows, current] = next_token
    return _tree_outputs(draft_tokens, emitted, mask, (current - 1).clamp_min(0), num_accepted)


def verify_sampled(
    draft_tokens: torch.Tensor,
    num_draft: list[int],
    draft_probs: torch.Tensor | None,
    parents: torch.Tensor | None,
    target_probs: torch.Tensor,
    sampling: SamplingBatch,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Exact verification of a sampled step, chains (``parents`` None) or trees, with each row's random
    numbers drawn from its own generator (``sampling``): its uniforms first, then its noise. A keyed batch
    (the deterministic mode) keeps the drafts equal to the target's keyed samples instead
    (:func:`keyed_winners`): exact too, and its tokens do not depend on the drafts.

    ``draft_tokens`` ``[B, K]``, ``num_draft`` ``[B]`` host ints, ``draft_probs`` ``[B, K, V]`` or None,
    ``target_probs`` ``[B, K+1, V]`` (``sampling.probs`` of the target's logits). Returns ``(output [B, K+1],
    num_accepted [B], path [B, K] or None)``; a chain's path (None) is its first ``num_accepted`` columns.
    The engine verifies every sampled step with it, and the cascade's middle model its inner drafts.
    """
    device, width = draft_tokens.device, draft_tokens.shape[1]
    counts = to_device(num_draft, device)
    if sampling.keyed:  # match the drafts against the target's keyed samples, as greedy rows match the argmax
        target_probs = keyed_winners(num_draft, parents, target_probs, sampling)
        draft_probs = None
        uniforms = target_probs.new_zeros(len(num_draft), width)
        noise = torch.ones_like(target_probs[:, 0])
    else:
        uniforms = sampling.uniforms(num_draft, width, device, target_probs.dtype)
        noise = sampling.noise(target_probs[:, 0])
    if parents is not None:
        return verify_tree_stochastic(draft_tokens, parents, counts, draft_probs, target_probs, uniforms, noise)
    output, num_accepted = verify_stochastic(draft_tokens, counts, draft_probs, target_probs, uniforms, noise)
    return output, num_accepted, None


def keyed_winners(num_draft: list[int], parents: torch.Tensor | None, target_probs: torch.Tensor,
                  sampling: SamplingBatch) -> torch.Tensor:
    """A keyed batch's target samples as one-hot distributions ``[B, K+1, V]``: column ``c`` of row ``b``
    (its first ``num_draft[b] + 1`` columns) is one-hot on ``argmax(p / E)``, ``E`` the keyed noise of the
    token it decides: ``c`` past the row's position on a chain, its node's depth on a tree
    (:mod:`specdec.keyed_noise`). Verified with zero uniforms and unit noise, a draft is then kept exactly
    when it equals that sample, and the token emitted after the kept ones is the sample: what plain decoding
    samples at each index, whatever was drafted."""
    if parents is None:
        offsets = [list(range(n + 1)) for n in num_draft]
    else:
        offsets = []
        for row, n in zip(parents.tolist(), num_draft):
            depth = [0] * n  # node i's depth, 1 for a child of the root
            for i in range(n):
                depth[i] = 1 + (depth[row[i]] if row[i] >= 0 else 0)
            offsets.append([0, *depth])
    columns = target_probs.shape[1]
    offsets = [row + [None] * (columns - len(row)) for row in offsets]
    noise = sampling.keyed_noise(offsets, target_probs.shape[-1], target_probs.dtype)
    winners = argmax(target_probs / noise)
    return torch.nn.functional.one_hot(winners, target_probs.shape[-1]).to(target_probs.dtype)
