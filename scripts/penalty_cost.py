"""What the logit adjustments cost: the embedded pair, the same prompts generated without adjustments and with
penalties (``--presence``, ``--frequency``, ``--repetition``) alternately (``--repeats`` rounds, the first discarded
as warm-up), per method; prints the median CPU milliseconds per output token of each (this process's, all threads:
steadier on a shared machine), τ (tokens per target step) of each, and the overhead. ``--shape``: the pair
inflated to a real shape (the toy pair's logits, so the same τ; a real step's cost).

    python3 scripts/penalty_cost.py --methods plain draft_model suffix --batch 1 8 --max-tokens 128
    python3 scripts/penalty_cost.py --shape 1b --shape-cache /tmp/shapes --methods plain draft_model --batch 1
"""

from __future__ import annotations

import argparse
import statistics
import time

from specdec import LLM, SamplingParams
from specdec.assets import require_default_pair

PROMPTS = ["def quicksort(arr):\n", "class Stack:\n", "import os\n\ndef walk(path):\n", "for i in range(10):\n",
           "def fib(n):\n", "class Node:\n    def __init__(self", "with open(path) as f:\n", "def parse(line):\n"]


def spec_of(method: str, k: int | str, draft: str) -> dict | None:
    if method == "plain":
        return None
    if method == "draft_model":
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    return {"method": method, "num_speculative_tokens": k}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=["plain", "draft_model", "suffix"])
    parser.add_argument("--k", type=lambda text: text if text == "auto" else int(text), default=4,
                        help="draft length, or auto")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--presence", type=float, default=0.5)
    parser.add_argument("--frequency", type=float, default=0.3)
    parser.add_argument("--repetition", type=float, default=1.1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shape", default=None, help="the pair inflated to this shape (e.g. 1b), as bench --shape")
    parser.add_argument("--shape-cache", default=None, help="where inflated pairs are kept (bench's --shape-cache)")
    args = parser.parse_args()
    if args.shape is None:
        target, draft = require_default_pair()
    else:
        from specdec.inflate.pair import cached_pair

        pair = cached_pair(args.shape, args.shape_cache)
        target, draft = pair.target, pair.draft
    adjustments = {"presence_penalty": args.presence, "frequency_penalty": args.frequency,
                   "repetition_penalty": args.repetition}
    for method in args.methods:
        llm = LLM(str(target), speculative_config=spec_of(method, args.k, str(draft)), max_num_seqs=max(args.batch))
        for batch in args.batch:
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
            cpu: dict[str, list[float]] = {"none": [], "penalized": []}
            tau: dict[str, list[float]] = {"none": [], "penalized": []}
            for repeat in range(args.repeats + 1):
                for label, extra in (("none", {}), ("penalized", adjustments)):
                    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=repeat,
                                            ignore_eos=True, **extra)
                    start = time.process_time()
                    outputs = llm.generate(prompts, params)
                    seconds = time.process_time() - start
                    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                    steps = sum(o.metrics.num_steps for o in outputs)
                    if repeat:
                        cpu[label].append(seconds / tokens)
                        tau[label].append(tokens / steps)
            base, adjusted = (statistics.median(v) for v in cpu.values())
            rounds = " / ".join(f"{label} {[round(v * 1e3, 3) for v in vs]}" for label, vs in cpu.items())
            print(f"{method} k={args.k} batch {batch} T={args.temperature} {adjustments}: "
                  f"none {base * 1e3:.3f} ms/token tau {statistics.median(tau['none']):.2f}, "
                  f"penalized {adjusted * 1e3:.3f} ms/token tau {statistics.median(tau['penalized']):.2f}, "
                  f"overhead {(adjusted / base - 1) * 100:+.1f}%; cpu rounds: {rounds}", flush=True)


if __name__ == "__main__":
    main()
