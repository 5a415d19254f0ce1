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

Both functions return ``(output_tokens [B, K+1], num_accepted [B])``; ``output_tokens[b,
:n+1]`` are the emitted tokens and the positions after them hold ``-1``.
"""

from __future__ import annotations

import torch


def _pad_after(tokens: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    return tokens.masked_fill(positions[None, :] > num_accepted[:, None], -1)


def _num_accepted(accept: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row of ``accept`` ``[B, K]``, within its ``num_draft``."""
    columns = torch.arange(accept.shape[1], device=accept.device)
    accept = accept & (columns[None, :] < num_draft[:, None])
    return accept.to(torch.int64).cumprod(dim=1).sum(dim=1)


def verify_greedy(
    draft_tokens: torch.Tensor, num_draft: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification against the target's argmax.

    ``draft_tokens`` ``[B, K]``, ``num_draft`` ``[B]``, ``target_logits`` ``[B, K+1, V]``
    (logits or probabilities).
    """
    target_tokens = target_logits.argmax(dim=-1)
    num_accepted = _num_accepted(draft_tokens == target_tokens[:, :-1], num_draft)
    return _pad_after(target_tokens, num_accepted), num_accepted


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
    next_token = (p_next / noise.to(p_next.dtype)).argmax(-1)

    output = torch.cat([draft_tokens, draft_tokens.new_full((batch, 1), -1)], dim=1)
    output[rows, num_accepted] = next_token
    return _pad_after(output, num_accepted), num_accepted
