"""Plain ``F.linear`` against a oneDNN-packed weight (``specdec.models.cpu_linear``) by row count, in float32
by default, on this CPU: a benchmark, not a test. Two measurements:

- ``products``: one product per shape and row count, cycling through at least 64 MB of distinct random
  weights so that every call reads memory; best of 5, microseconds per call, plain / packed;
- ``forward``: with ``--model DIR``, the fast backend's forward of that model (packed, as it loads) over
  1, 2, 3, 5 and 9 tokens of one row after 200 cached tokens; the median of the last 3 of 4 calls, ms.
  Run it from two checkouts (``PYTHONPATH=OTHER/src``) to compare the backend before and after.

    python scripts/cpu_linear_rows.py products
    python scripts/cpu_linear_rows.py forward --model ~/.cache/specdec/shapes/1b-*/target
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from specdec.models.base import ForwardBatch
from specdec.models.cpu_linear import linear
from specdec.models.loader import cpu_features, load_causal_lm

SHAPES = [(1536, 512), (8192, 512), (8192, 256), (192, 256), (2560, 2048), (8192, 2048)]
ROWS = [1, 2, 3, 5, 8, 16, 32, 64, 128]


def products(dtype: torch.dtype) -> None:
    packed_of = torch.ops.mkldnn._reorder_linear_weight
    for out, width in SHAPES:
        count = max(2, int(64e6 / (out * width * dtype.itemsize)))
        plain = [torch.randn(out, width, dtype=dtype) for _ in range(count)]
        packed = [packed_of(w, None) for w in plain]
        cells = []
        for rows in ROWS:
            x = torch.randn(rows, width, dtype=dtype)
            best = []
            for fn, weights in ((F.linear, plain), (linear, packed)):
                runs = []
                for _ in range(5):
                    start = time.perf_counter()
                    for w in weights:
                        fn(x, w)
                    runs.append((time.perf_counter() - start) / len(weights) * 1e6)
                best.append(min(runs))
            cells.append(f"{rows}:{best[0]:.0f}/{best[1]:.0f}")
        print(f"{out}x{width}", " ".join(cells), "us plain/packed")


def forward(model: str, cached: int = 200) -> None:
    lm = load_causal_lm(model, device="cpu")
    print(lm.name, lm.dtype)
    cache = lm.new_cache(1, cached + 16)
    with torch.inference_mode():
        for n in (1, 2, 3, 5, 9):
            times = []
            for _ in range(4):
                cache.lengths[0] = cached
                tokens, positions = torch.randint(0, lm.vocab_size, (n,)), torch.arange(cached, cached + n)
                batch = ForwardBatch(tokens, positions, [0], [0, n])
                start = time.perf_counter()
                lm.forward(batch, cache)
                times.append(time.perf_counter() - start)
            print(f"{n} tokens: {statistics.median(times[1:]) * 1e3:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("measure", nargs="+", choices=["products", "forward"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--model", help="forward: a model folder (e.g. an inflated shape's target)")
    args = parser.parse_args()
    print(f"cpu: {cpu_features()}, {torch.get_num_threads()} threads")
    if "products" in args.measure:
        products(getattr(torch, args.dtype))
    if "forward" in args.measure:
        if not args.model:
            parser.error("forward needs --model")
        forward(args.model)


if __name__ == "__main__":
    main()
