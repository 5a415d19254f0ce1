"""Resident memory over many requests of varying prompt lengths: a benchmark, not a test.

Runs ``--requests`` requests with random token-id prompts of 1..``--max-prompt`` tokens through
one ``LLM`` on the embedded target (default dtype: bf16 on a CPU that has it) and prints the
resident set size after the warm-up and then every ``--every`` requests, so that growth per
request (per-shape kernel state, leaks) shows.

    python scripts/memory_soak.py --requests 1000 --warmup 100
"""

from __future__ import annotations

import argparse
import random

from specdec import LLM, SamplingParams
from specdec.assets import require_default_pair


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--max-prompt", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--method", default="none", choices=["none", "ngram", "draft_model"])
    args = parser.parse_args()
    target, draft = require_default_pair()
    config = None
    if args.method == "ngram":
        config = {"method": "ngram", "num_speculative_tokens": 4}
    elif args.method == "draft_model":
        config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}
    llm = LLM(str(target), dtype=args.dtype, speculative_config=config, max_num_seqs=4)
    vocab = llm.target.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"dtype {llm.target.dtype}, method {args.method}, start {resident_mib():.0f} MiB")
    base = None
    for i in range(1, args.requests + 1):
        n = rng.randrange(1, args.max_prompt + 1)
        llm.generate({"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(n)]}, params)
        if i == args.warmup:
            base = resident_mib()
            print(f"after warm-up ({i} requests): {base:.0f} MiB")
        elif i % args.every == 0 and base is not None:
            now = resident_mib()
            print(f"after {i} requests: {now:.0f} MiB ({100 * (now - base) / base:+.1f}% since warm-up)")


if __name__ == "__main__":
    main()
