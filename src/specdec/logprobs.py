"""Log probabilities of emitted tokens, read from the target's logits at the verified positions.

Which distribution: the target's *raw* log-softmax, before temperature, top-k, top-p and min-p (vLLM's
default, ``logprobs_mode="raw_logprobs"``), so a token's value does not depend on the sampling settings.
Under a structured-output constraint it is the target's distribution *with the grammar's forbidden tokens
removed and renormalised* (the logits the step samples from, before temperature): vLLM applies the grammar
bitmask before its sampler computes raw logprobs too. Forbidden tokens have probability zero and are never
listed among the top tokens.

With speculation the values are plain decoding's: the verify forward already computes the target's logits at
every verified position; the emitted token ``i`` of a step was decided at the pending token (``i = 0``) or at
the ``i``-th accepted node, and its logprobs are read at that position. No extra forward runs; one more host
read runs in a step where some row asks for logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20
"""The most top tokens a request may ask for per position (OpenAI's chat API and vLLM's default)."""


@dataclass(frozen=True)
class Logprob:
    """vLLM's ``Logprob``: a token's log probability, its ``rank`` (1 = the most likely; the number of
    tokens at least as likely as it) and its text (``decoded_token``; None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class TokenLogprobs:
    """What the engine hands back per emitted token: the chosen token's ``logprob`` and ``rank``, and the
    ``top_ids``/``top_logprobs`` of the most likely tokens, best first (at most the request's ``logprobs``;
    forbidden tokens of a constraint left out)."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """Logprobs of ``chosen`` ``[M]`` under ``logits`` ``[M, V]`` (raw log-softmax; float64 logits stay
    float64, anything else is computed in float32) and the ``num_top[m]`` most likely tokens of each row.
    One host read."""
    work = logits if logits.dtype == torch.float64 else logits.float()
    logprobs = torch.log_softmax(work, dim=-1)
    picked = logprobs.gather(-1, chosen.view(-1, 1))  # [M, 1]
    rank = (logprobs >= picked).sum(-1, keepdim=True)  # [M, 1]
    width = max(num_top, default=0)
    top = logprobs.topk(width, dim=-1) if width else None
    parts = [picked.double(), rank.double()]
    if top is not None:
        parts += [top.values.double(), top.indices.double()]  # token ids are exact in float64
    rows = torch.cat(parts, dim=1).tolist()
    out = []
    for row, n in zip(rows, num_top):
        values, ids = row[2 : 2 + n], row[2 + width : 2 + width + n]
        keep = [i for i, v in enumerate(values) if v != float("-inf")]
        out.append(TokenLogprobs(row[0], int(row[1]), [int(ids[i]) for i in keep], [values[i] for i in keep]))
    return out
