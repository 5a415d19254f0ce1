"""``min_tokens`` (vLLM's sampling field): a request's stop tokens cannot be generated before its
``min_tokens``-th output token.

Terms: a row's *stop tokens* are ``Sequence.stop_ids`` (``stop_token_ids``, and end-of-sequence unless
``ignore_eos``); the *floor* of a row is ``min_tokens`` less the tokens it has generated; a column ``j`` of a
step's target logits decides the output token at index ``num_generated + depth[j]`` (``depth[j] = j`` in a
chain, the node's depth in a tree, 0 for the pending token's column).

Where that index is below ``min_tokens``, the stop tokens' logits are set to ``-inf`` before verification.
The target's distribution at every position is then the one plain decoding samples from with ``min_tokens``,
and exact verification (greedy matching or rejection sampling, which hold for any draft distribution) keeps
speculation's output equal to plain decoding's: a drafted stop token below the floor has target probability
zero and is rejected. Stop strings are not looked for in the text of the first ``min_tokens`` tokens
(:class:`~specdec.text.TextTracker`), as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence as Sequence_

import torch

from specdec.models.base import to_device
from specdec.sequence import Sequence


def below_floor(seqs: Sequence_[Sequence]) -> bool:
    """Whether some row may not stop yet (a step without one skips :func:`ban_early_stops`)."""
    return any(s.num_generated < s.params.min_tokens and s.stop_ids for s in seqs)


def ban_early_stops(logits: torch.Tensor, seqs: Sequence_[Sequence], depth: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """``logits`` ``[B, C, V]`` (or ``[B, V]``: one column) with each row's stop tokens at ``-inf`` in the
    columns whose output index is below its ``min_tokens``; ``depth`` ``[B, C]``: each column's depth (None: a
    chain's, ``j``). Returns a new tensor (the input is kept for what reads it unmasked)."""
    flat = logits.dim() == 2
    scores = logits[:, None] if flat else logits
    rows, columns, vocab = scores.shape
    device = scores.device
    stop_rows, stop_tokens = [], []
    for b, s in enumerate(seqs):
        if s.num_generated < s.params.min_tokens:
            ids = [t for t in s.stop_ids if t < vocab]
            stop_rows += [b] * len(ids)
            stop_tokens += ids
    stops = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
    stops[to_device(stop_rows, device), to_device(stop_tokens, device)] = True  # [B, V]
    floor = to_device([max(0, s.params.min_tokens - s.num_generated) for s in seqs], device)  # [B]
    if depth is None:
        depth = torch.arange(columns, device=device)[None]
    early = depth < floor[:, None]  # [B, C]: the column's token is below the row's floor
    banned = scores.masked_fill(early[:, :, None] & stops[:, None, :], -torch.inf)
    return banned[:, 0] if flat else banned
