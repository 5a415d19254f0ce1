"""Median seconds of one ragged forward on the embedded pair (2 threads): rows of very different lengths, as a
drafter's catch-up or prompts fed together make them. A benchmark, not a test. Run it from two checkouts
(``PYTHONPATH=OTHER/src``) to compare how they lay the rows out (``specdec.models.segments``).

    python scripts/ragged_forward.py --model eagle   # the EAGLE layer fed the target's features
    python scripts/ragged_forward.py --model target  # the target fed tokens

The default rows are the largest catch-up of the EAGLE layer seen in a 64-stream ``bench-serve`` run: 47 rows,
1,234 tokens, each row's cache already holding a 100-token context.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec import LLM
from specdec.assets import require_default_pair
from specdec.models.base import ForwardBatch

CATCH_UP = [14] * 10 + [13, 13, 13, 14, 13] + [14] * 5 + [49, 65, 26, 28, 39, 28, 24, 104, 24, 29, 40, 25, 36, 44, 43,
                                                           19, 26, 98, 27, 65, 15, 13, 12, 37, 17, 10, 15]
CONTEXT = 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("eagle", "target"), default="eagle")
    parser.add_argument("--rows", type=int, nargs="+", default=CATCH_UP, help="tokens of each row")
    parser.add_argument("--calls", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(2)
    target, _ = require_default_pair()
    llm = LLM(str(target), speculative_config={"method": "eagle", "num_speculative_tokens": 4},
              max_num_seqs=len(args.rows))
    drafter = llm.engine.drafter
    model, cache = (drafter.layer, drafter.cache) if args.model == "eagle" else (llm.engine.target, llm.engine.cache)
    slots = list(range(len(args.rows)))
    gen = torch.Generator().manual_seed(0)
    for slot in slots:  # every row's context, fed one row at a time
        context = ForwardBatch.from_rows([[(7 * i + slot) % 900 + 3 for i in range(CONTEXT)]], [0], [slot],
                                         model.device, logits="none")
        if args.model == "eagle":
            context.input_hidden = torch.randn(CONTEXT, model.embed.shape[1], generator=gen).to(model.dtype)
        model.forward(context, cache)
    rows = [[(5 * i + r) % 900 + 3 for i in range(n)] for r, n in enumerate(args.rows)]
    batch = ForwardBatch.from_rows(rows, [CONTEXT] * len(rows), slots, model.device)
    batch.logits_rows = torch.tensor([c - 1 for c in batch.cu_seqlens[1:]])
    if args.model == "eagle":
        batch.input_hidden = torch.randn(batch.cu_seqlens[-1], model.embed.shape[1], generator=gen).to(model.dtype)
        batch.hidden_layers = (-1,)
    seconds = []
    for _ in range(args.calls):
        tic = time.perf_counter()
        model.forward(batch, cache)
        seconds.append(time.perf_counter() - tic)
        for slot in slots:
            cache.set_length(slot, CONTEXT)
    print(f"{args.model}: {len(rows)} rows, {sum(args.rows)} tokens: median {statistics.median(seconds) * 1000:.1f} ms "
          f"(min {min(seconds) * 1000:.1f}) over {args.calls} calls")


if __name__ == "__main__":
    main()
