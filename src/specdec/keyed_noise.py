"""The deterministic mode's random numbers: a function of a request's seed and a token's index.

In the default mode a sampled row draws its random numbers from its own generator, in the order its
steps ask for them: how many it draws depends on what was drafted (a uniform per draft token, the
race's noise once per step), so a seeded request repeats its tokens only where its drafts repeat.
Drafts that depend on more than the request's own context (a suffix cache fed by other requests, a k
chosen from measured timings, the drafter the auto method picked) then change a seeded request's tokens
from run to run; the output is distributed as the target's all the same.

Keyed, the token at index ``t`` of a request with seed ``s`` (its generator's initial seed) is the
exponential race ``argmax(p_t / E)`` over its sampling distribution ``p_t`` with ``E ~ Exp(1)`` drawn
from a generator seeded with :func:`mix` ``(s, t)``: exactly a sample of ``p_t`` (the race's winner is
distributed as ``p``), from noise that depends on ``(s, t)`` only. Speculation then verifies a draft
token by equality with that winner (:func:`specdec.verify.verify_sampled`), as greedy verification
does with the argmax, so a request's tokens are those plain decoding samples, whatever was drafted,
and drafts are accepted with probability ``p_t`` of the winner. A drafter sampling its draft for index
``t`` with the same noise (:meth:`specdec.sampling.SamplingBatch.sample` at that index) couples its
draft to the target's token: with ``q`` close to ``p`` their races mostly pick the same token.
"""

from __future__ import annotations

import torch

_MASK = 2**64 - 1


def mix(key: int, index: int) -> int:
    """A 64-bit seed from a request's ``key`` and a token ``index`` (splitmix64's finaliser over
    ``key ^ index * golden``): nearby indices give unrelated seeds."""
    x = (key ^ (index * 0x9E3779B97F4A7C15)) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def keyed_noise(keys: list[int], indices: list[list[int]], vocab: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """``[B, C, vocab]`` exponential noise: ``[b, c]`` drawn from a generator seeded with ``mix(keys[b],
    indices[b][c])`` (every ``indices[b]`` of length ``C``), ones where ``indices[b][c]`` is None."""
    width = max((len(row) for row in indices), default=0)
    out = torch.ones(len(keys), width, vocab, dtype=dtype, device=device)
    generator = torch.Generator(device=device)
    for b, (key, row) in enumerate(zip(keys, indices)):
        for c, index in enumerate(row):
            if index is not None:
                generator.manual_seed(mix(key, index))
                out[b, c].exponential_(generator=generator)
    return out.clamp_min_(torch.finfo(dtype).tiny)
