"""The decoding loop: one speculative step as numbered stages, yielded step by step.

Cache invariant (chain): the target's cache holds every committed token except the last,
the *pending* token. A step feeds ``[pending, d_1..d_k]`` at positions ``L..L+k``; with
``n`` drafts accepted the cache is cropped to ``L+1+n`` and the recovered or bonus token
becomes the new pending token. Plain decoding is the same loop with no drafter (k = 0).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from specdec.drafters.base import Draft, Drafter
from specdec.metrics import RequestMetrics
from specdec.models.base import CachedLM
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.verify import verify_greedy, verify_stochastic


@dataclass
class StepOutput:
    """What one step committed: ``token_ids`` (stops and ``max_tokens`` already applied),
    how many tokens were drafted and accepted, and ``finish_reason`` (None, "stop" or "length")."""

    token_ids: list[int]
    num_drafted: int
    num_accepted: int
    finish_reason: str | None


class SpeculativeEngine:
    """Runs requests on a target model with an optional drafter, ``k`` draft tokens per step."""

    def __init__(
        self, target: CachedLM, drafter: Drafter | None, num_speculative_tokens: int, eos_token_ids: set[int]
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.k = num_speculative_tokens if drafter is not None else 0
        self.eos_token_ids = frozenset(eos_token_ids)

    def max_new_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """``max_tokens``, capped so that prompt plus output fit the target's context window."""
        return min(params.max_tokens, self.target.max_length - num_prompt_tokens)

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator, metrics: RequestMetrics
    ) -> Iterator[StepOutput]:
        """Yield one :class:`StepOutput` per target step until a stop condition; fills ``metrics``."""
        target, drafter = self.target, self.drafter
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        budget = self.max_new_tokens(len(prompt_ids), params)
        metrics.num_prompt_tokens = len(prompt_ids)

        # 0. Prefill: every prompt token but the last (the first pending token) into the caches.
        tic = time.perf_counter()
        target.reset()
        if len(prompt_ids) > 1:
            target.forward(self._tensor(prompt_ids[:-1]), num_logits=0)
        if drafter is not None:
            drafter.begin(prompt_ids, params, generator)
        metrics.time_prefill += time.perf_counter() - tic

        context = list(prompt_ids)
        generated = 0
        while True:
            # 1. Propose: at most k drafts, and never more than the tokens still allowed minus
            #    the one the target always adds.
            tic = time.perf_counter()
            k = min(self.k, budget - generated - 1)
            draft = drafter.propose(context, k) if drafter is not None and k > 0 else None
            num_drafted = draft.num_tokens if draft is not None else 0
            toc = time.perf_counter()
            metrics.time_drafting += toc - tic

            # 2. Target forward over [pending, d_1..d_k] at positions L..L+k.
            cache_length = target.length
            step_input = self._tensor(context[-1:])
            if num_drafted:
                step_input = torch.cat([step_input, draft.tokens], dim=1)
            logits = target.forward(step_input)
            tic = time.perf_counter()
            metrics.time_target += tic - toc

            # 3. Verify: greedy argmax matching, or exact rejection sampling.
            output, num_accepted = self._verify(draft, num_drafted, logits, params, generator)

            # 4. Commit: emit accepted drafts plus the recovered/bonus token, stopping exactly at a
            #    stop token or the token budget; roll the target cache back to L+1+n.
            emitted = []
            finish_reason = None
            for token in output[: num_accepted + 1]:
                emitted.append(token)
                generated += 1
                if token in stop_ids:
                    finish_reason = "stop"
                elif generated >= budget:
                    finish_reason = "length"
                if finish_reason:
                    break
            context.extend(emitted)
            target.crop(cache_length + 1 + num_accepted)
            metrics.record_step(num_drafted, num_accepted, len(emitted))
            toc = time.perf_counter()
            metrics.time_other += toc - tic

            # 5. Observe: the drafter rolls back its own state and adapts.
            if drafter is not None and finish_reason is None:
                drafter.observe(context, num_accepted)
                metrics.time_drafting += time.perf_counter() - toc

            # 6. Hand the step to the caller (text, streaming and stop strings live above).
            yield StepOutput(emitted, num_drafted, num_accepted, finish_reason)
            if finish_reason:
                return

    def _tensor(self, token_ids: list[int]) -> torch.Tensor:
        return torch.tensor([token_ids], dtype=torch.long, device=self.target.device)

    @staticmethod
    def _verify(
        draft: Draft | None, num_drafted: int, logits: torch.Tensor, params: SamplingParams,
        generator: torch.Generator,
    ) -> tuple[list[int], int]:
        """Returns the emitted-token candidates (``n+1`` of them) and ``n``, the accepted count."""
        tokens = draft.tokens if num_drafted else logits.new_empty(1, 0, dtype=torch.long)
        if params.greedy:
            output, num_accepted = verify_greedy(tokens, logits)
        else:
            probs = draft.probs if num_drafted else None
            output, num_accepted = verify_stochastic(tokens, probs, logits_to_probs(logits, params), generator)
        n = int(num_accepted[0])
        return output[0, : n + 1].tolist(), n
