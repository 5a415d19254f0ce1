"""Verification of draft tokens: pure tensor functions, no models, no caches.

Vocabulary (one step, one sequence of the batch; shapes carry a leading batch ``B``):

- ``draft_tokens`` ``[B, k]``: the k tokens ``d_1..d_k`` a drafter proposed.
- ``draft_probs`` ``q`` ``[B, k, V]``: the distribution each draft token was sampled from,
  or None for a deterministic drafter (n-gram lookup), which is verified as if ``q`` were
  one-hot on its token.
- ``target_probs`` ``p`` ``[B, k+1, V]``: the target's distribution after the pending token
  and after each draft token; row ``i`` scores ``d_{i+1}``, row ``k`` follows ``d_k``.
- accepted: draft token ``d_i`` is kept with probability ``min(1, p_i(d_i) / q_i(d_i))``;
  verification stops at the first rejection. ``num_accepted`` ``[B]`` counts the kept prefix.
- recovered token: at the first rejection ``n``, a token is drawn from the residual
  ``norm(max(p_n - q_n, 0))``.
- bonus token: when all k are accepted, a token is drawn from ``p_k``.

Each sequence therefore emits ``num_accepted + 1`` tokens, distributed exactly as the target
would have sampled them one at a time (Leviathan et al. 2023; Chen et al. 2023). Greedy
verification keeps the longest prefix equal to the target's argmax and emits the argmax at the
first mismatch (or after the last draft).

Both functions return ``(output_tokens [B, k+1], num_accepted [B])``; ``output_tokens[b, :n+1]``
are the emitted tokens and positions after them hold ``-1``.
"""

from __future__ import annotations

import torch


def _pad_after(tokens: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    return tokens.masked_fill(positions[None, :] > num_accepted[:, None], -1)


def _num_accepted(accept: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row of ``accept`` ``[B, k]``."""
    return accept.to(torch.int64).cumprod(dim=1).sum(dim=1)


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification against the target's argmax.

    ``draft_tokens`` ``[B, k]``, ``target_logits`` ``[B, k+1, V]`` (logits or probabilities).
    """
    target_tokens = target_logits.argmax(dim=-1)
    num_accepted = _num_accepted(draft_tokens == target_tokens[:, :-1])
    return _pad_after(target_tokens, num_accepted), num_accepted


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(p - q, 0))`` over the last dimension; falls back to ``p`` where it is all zero."""
    residual = (p - q).clamp_min_(0)
    total = residual.sum(-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp_min(torch.finfo(p.dtype).tiny), p)


def verify_stochastic(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact rejection sampling of a chain draft (see the module docstring).

    ``draft_tokens`` ``[B, k]``, ``draft_probs`` ``[B, k, V]`` or None, ``target_probs``
    ``[B, k+1, V]``. Random numbers come from ``generator`` so that a seeded request is
    reproducible.
    """
    batch, k = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    p_draft = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    uniform = torch.rand(p_draft.shape, generator=generator, device=p_draft.device, dtype=p_draft.dtype)
    num_accepted = _num_accepted(uniform * q_draft < p_draft)

    # The distribution of the one token emitted after the accepted prefix.
    p_next = target_probs[rows, num_accepted]
    rejected = num_accepted < k
    if bool(rejected.any()):
        at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_next = torch.nn.functional.one_hot(draft_tokens[rows, at], p_next.shape[-1]).to(p_next.dtype)
        else:
            q_next = draft_probs[rows, at]
        p_next = torch.where(rejected[:, None], residual_distribution(p_next, q_next), p_next)
    next_token = torch.multinomial(p_next, 1, generator=generator).squeeze(-1)

    output = torch.cat([draft_tokens, draft_tokens.new_full((batch, 1), -1)], dim=1)
    output[rows, num_accepted] = next_token
    return _pad_after(output, num_accepted), num_accepted
