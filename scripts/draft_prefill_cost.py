"""What a prompt costs the draft model against the target, on this machine: the draft and the target of the
embedded pair (or a shape inflated from it) each loaded alone, timing ``LLM.generate`` of one random
96-token prompt for 1 and for 9 tokens (best of a few calls). The prefill is the 1-token call less one
decoding step; a decoding step is the difference over 8. A benchmark, not a test:
``docs/lab-notes/2026-11-28-step-bound.md`` used it for what a switched-off draft_model still pays.

    python scripts/draft_prefill_cost.py --shape 1b --shape-cache /tmp/inflate_1b
"""

from __future__ import annotations

import argparse
import time

import torch

from specdec import LLM, SamplingParams

PROMPT_TOKENS = 96


def seconds(llm: LLM, prompt: list[int], tokens: int, calls: int) -> float:
    """The best of ``calls`` timed generations of ``tokens`` greedy tokens after ``prompt``."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default=None, help="an inflated shape (1b, ...); default the embedded pair")
    parser.add_argument("--shape-cache", default=None)
    args = parser.parse_args()
    if args.shape is None:
        from specdec.assets import require_default_pair

        target, draft = require_default_pair()
    else:
        from specdec.inflate.pair import cached_pair

        inflated = cached_pair(args.shape, args.shape_cache)
        target, draft = inflated.target, inflated.draft
    prompt = torch.randint(100, 2000, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()
    for name, folder in (("draft", draft), ("target", target)):
        llm = LLM(str(folder), max_num_seqs=1)
        seconds(llm, prompt, 1, 1)  # warm-up
        one, nine = seconds(llm, prompt, 1, 3), seconds(llm, prompt, 9, 2)
        step = (nine - one) / 8
        print(f"{name}: prefill of {PROMPT_TOKENS} tokens {(one - step) * 1e3:.0f} ms, a decoding step "
              f"{step * 1e3:.0f} ms")
        del llm


if __name__ == "__main__":
    main()
