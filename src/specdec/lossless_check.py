"""Checks that a speculative configuration is lossless on given models (``specdec verify``).

Two checks, each against plain decoding of the same target:

- greedy: every prompt's speculative greedy output (all prompts in one batch) equals plain greedy
  output token for token; at the first difference, :func:`specdec.greedy_check.check_greedy`
  tells a rounding tie (the two tokens' logits within the dtype's rounding) from a real mismatch
  and reports the target's top-2 logit gap there;
- sampling: on a few prompts, the first two sampled tokens of many seeded requests, under a
  top-k restricted distribution (so its ``k²`` outcomes can be enumerated from the target), follow
  the target's exact joint distribution by Pearson's chi-square test.

Both run with the request's penalties when given: the reference then adjusts the target's logits as plain
decoding does (:func:`specdec.penalties.adjusted_position`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.greedy_check import GreedyVerdict, check_greedy, next_token_logits
from specdec.llm import LLM
from specdec.penalties import adjusted_position
from specdec.sampling import SamplingParams, logits_to_probs

MIN_EXPECTED = 5.0  # cells expected fewer times than this are pooled into one for the chi-square test


def greedy_equality(reference: LLM, candidate: LLM, prompts: list[list[int]], max_tokens: int,
                    penalties: dict[str, float] | None = None) -> list[GreedyVerdict]:
    """One verdict per prompt: ``candidate``'s greedy output against ``reference``'s (plain decoding of
    the same target), ``max_tokens`` tokens each, end-of-sequence ignored, every prompt in one batch;
    ``penalties``: ``SamplingParams`` penalty fields both run with."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **(penalties or {}))
    requests = [{"prompt_token_ids": p} for p in prompts]
    plain = reference.generate(requests, params)
    speculative = candidate.generate(requests, params)
    return [check_greedy(reference.target, p, a.outputs[0].token_ids, b.outputs[0].token_ids,
                         adjust=_adjust(p, params))
            for p, a, b in zip(prompts, plain, speculative, strict=True)]


def _adjust(prompt: list[int], params: SamplingParams):
    """The adjustment of one position's logits after an output (None without penalties)."""
    if not params.adjusts_logits:
        return None
    return lambda logits, output: adjusted_position(logits, prompt, output, params)


@dataclass
class SamplingCheck:
    """Chi-square test of one prompt's first two sampled tokens: ``statistic`` on ``dof`` degrees of
    freedom, ``pvalue``; ``samples`` requests; ``cells`` outcomes the target can produce; ``impossible``
    samples the target could never have produced (any makes ``pvalue`` 0)."""

    statistic: float
    dof: int
    pvalue: float
    samples: int
    cells: int
    impossible: int


def exact_first_two(reference: LLM, prompt: list[int], params: SamplingParams) -> dict[tuple[int, int], float]:
    """The target's probability of each ``(t1, t2)`` under ``params`` (top-k keeps it to ``k²`` pairs),
    from fresh forwards of the prompt and of the prompt plus each possible first token."""
    adjust = _adjust(prompt, params) or (lambda logits, output: logits)
    first = logits_to_probs(adjust(next_token_logits(reference.target, prompt).double(), []), params)
    joint = {}
    for t1 in first.nonzero().flatten().tolist():
        second = logits_to_probs(adjust(next_token_logits(reference.target, [*prompt, t1]).double(), [t1]), params)
        for t2 in second.nonzero().flatten().tolist():
            joint[(t1, t2)] = first[t1].item() * second[t2].item()
    return joint


def chi_square(counts: dict[tuple[int, int], int], probs: dict[tuple[int, int], float]) -> SamplingCheck:
    """Pearson's test of ``counts`` against ``probs``, with cells expected fewer than
    :data:`MIN_EXPECTED` times pooled into one."""
    samples = sum(counts.values())
    impossible = sum(n for cell, n in counts.items() if cell not in probs)
    observed, expected, pooled_obs, pooled_exp = [], [], 0.0, 0.0
    for cell, p in probs.items():
        e, o = p * samples, counts.get(cell, 0)
        if e >= MIN_EXPECTED:
            observed.append(o)
            expected.append(e)
        else:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    obs, exp = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    exp = exp * obs.sum() / exp.sum()
    statistic = float(((obs - exp) ** 2 / exp).sum())
    dof = max(len(observed) - 1, 1)
    pvalue = 0.0 if impossible else float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                                                    torch.tensor(statistic / 2.0, dtype=torch.float64)))
    return SamplingCheck(statistic, dof, pvalue, samples, len(probs), impossible)


def sampling_exactness(reference: LLM, candidate: LLM, prompt: list[int], temperature: float, top_k: int,
                       samples: int, seed: int = 0, penalties: dict[str, float] | None = None) -> SamplingCheck:
    """``samples`` seeded requests of two tokens (end-of-sequence ignored) through ``candidate``, batched,
    compared with the target's exact distribution of the first two tokens under
    ``temperature``, ``top_k`` and ``penalties`` (``SamplingParams`` penalty fields)."""
    params = [SamplingParams(temperature=temperature, top_k=top_k, max_tokens=2, ignore_eos=True,
                             seed=seed * 1_000_003 + i, **(penalties or {})) for i in range(samples)]
    outputs = candidate.generate([{"prompt_token_ids": prompt}] * samples, params)
    counts: dict[tuple[int, int], int] = {}
    for out in outputs:
        t1, t2 = out.outputs[0].token_ids
        counts[(t1, t2)] = counts.get((t1, t2), 0) + 1
    return chi_square(counts, exact_first_two(reference, prompt, params[0]))
