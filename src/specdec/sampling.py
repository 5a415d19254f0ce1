"""Sampling parameters and the one function that turns logits into a distribution.

``logits_to_probs`` serves plain decoding, draft sampling and verification alike: the
target distribution ``p`` that speculative decoding preserves is exactly the one plain
decoding samples from, with temperature, top-k, top-p and min-p applied identically.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specdec.errors import SpecDecError


@dataclass
class SamplingParams:
    """How one request samples and when it stops (vLLM's names and defaults).

    ``temperature=0`` is greedy decoding. ``top_k`` of 0 or -1 disables top-k. A fixed
    ``seed`` makes a request reproducible whatever else runs in the same process.
    ``stop`` strings end generation; the returned text excludes the stop string.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise SpecDecError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise SpecDecError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise SpecDecError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise SpecDecError(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise SpecDecError(f"top_k must be an integer >= -1 (0 or -1 disable it), got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SpecDecError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise SpecDecError(f"seed must be an integer or None, got {self.seed!r}")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise SpecDecError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop_strings = tuple(stops)
        ids = list(self.stop_token_ids or [])
        if any(not isinstance(t, int) or t < 0 for t in ids):
            raise SpecDecError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = ids

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits ``[..., V]`` into the sampling distribution ``[..., V]``.

    Order: temperature, softmax, top-k, top-p, min-p, renormalise. Float64 logits stay
    float64 (exactness tests); anything else is computed in float32. Greedy parameters
    give a one-hot distribution on the argmax.
    """
    work = logits if logits.dtype == torch.float64 else logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(work.argmax(-1), work.shape[-1]).to(work.dtype)
    probs = torch.softmax(work / params.temperature, dim=-1)
    if params.top_k > 0 and params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k, dim=-1).values[..., -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
    if params.top_p < 1.0:
        probs = probs / probs.sum(-1, keepdim=True)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    if params.min_p > 0.0:
        threshold = params.min_p * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of ``probs`` ``[B, V]``; returns ``[B]`` int64."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
