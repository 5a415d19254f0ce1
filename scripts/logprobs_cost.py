"""The per-token cost of logprobs: the embedded pair with speculation, the same prompts generated with
``logprobs=None`` and ``logprobs=N`` alternately (``--repeats`` rounds, first round discarded as warm-up),
at each batch size; prints the median wall and CPU (this process's, all threads: steadier on a shared machine)
milliseconds per output token of each and the overhead.

    python3 scripts/logprobs_cost.py --method draft_model --k 4 --top 5 --batch 1 8 --max-tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import time

from specdec import LLM, SamplingParams
from specdec.assets import require_default_pair

PROMPTS = ["def quicksort(arr):\n", "class Stack:\n", "import os\n\ndef walk(path):\n", "for i in range(10):\n",
           "def fib(n):\n", "class Node:\n    def __init__(self", "with open(path) as f:\n", "def parse(line):\n"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="draft_model", choices=["draft_model", "plain"])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    target, draft = require_default_pair()
    spec = None if args.method == "plain" else {"method": "draft_model", "model": str(draft),
                                                 "num_speculative_tokens": args.k}
    llm = LLM(str(target), speculative_config=spec, max_num_seqs=max(args.batch))
    for batch in args.batch:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
        timings: dict[str, list[float]] = {"none": [], f"top{args.top}": []}
        cpu: dict[str, list[float]] = {"none": [], f"top{args.top}": []}
        for repeat in range(args.repeats + 1):
            for label, logprobs in (("none", None), (f"top{args.top}", args.top)):
                params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=repeat,
                                        ignore_eos=True, logprobs=logprobs)
                start, start_cpu = time.perf_counter(), time.process_time()
                outputs = llm.generate(prompts, params)
                seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                if repeat:
                    timings[label].append(seconds / tokens)
                    cpu[label].append(cpu_seconds / tokens)
        for kind, values in (("wall", timings), ("cpu", cpu)):
            base, with_lp = (statistics.median(v) for v in values.values())
            rounds = " / ".join(f"{label} {[round(v * 1e3, 3) for v in vs]}" for label, vs in values.items())
            print(f"batch {batch} {kind}: {args.method} k={args.k} T={args.temperature}: "
                  f"none {base * 1e3:.3f} ms/token, "
                  f"logprobs={args.top} {with_lp * 1e3:.3f} ms/token, overhead {(with_lp / base - 1) * 100:+.1f}% "
                  f"({(with_lp - base) * 1e6:+.1f} us/token); rounds: {rounds}", flush=True)


if __name__ == "__main__":
    main()
