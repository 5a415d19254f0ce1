"""Best-of-N tokens/s of one greedy 128-token generation at batch 1 on the embedded pair: a
benchmark, not a test. Run it alternately from two checkouts (``PYTHONPATH=OTHER/src``) to
compare commits with less noise than a whole ``specdec bench`` run.

    python scripts/batch1_timing.py draft_model --calls 7
"""

from __future__ import annotations

import argparse
import inspect
import time

from specdec import LLM, SamplingParams
from specdec.assets import require_default_pair

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("method", choices=["plain", "draft_model", "ngram"])
    parser.add_argument("--calls", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    target, draft = require_default_pair()
    config = {
        "plain": None,
        "draft_model": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4},
        "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    }[args.method]
    # The batch-1 engine had no max_num_seqs; the batched one runs with one slot.
    extra = {"max_num_seqs": 1} if "max_num_seqs" in inspect.signature(LLM).parameters else {}
    llm = LLM(str(target), speculative_config=config, **extra)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([PROMPT], params)  # warm-up
    best = min(_timed(llm, params) for _ in range(args.calls))
    print(f"{args.method}: best of {args.calls} calls {best:.4f} s, {args.max_tokens / best:.1f} tok/s")


def _timed(llm: LLM, params: SamplingParams) -> float:
    tic = time.perf_counter()
    llm.generate([PROMPT], params)
    return time.perf_counter() - tic


if __name__ == "__main__":
    main()
