"""A CPU decoding forward over rows that attend different cache lengths, as one grid and in key groups
(``specdec.models.segments.key_groups``), on this machine: a benchmark, not a test.

Each case is a list of cached lengths; every row feeds ``--tokens`` tokens after its own. The threshold
``SEGMENT_KEYS`` is set at run time (``10**9``: never split, one grid, against the shipped value), the two
alternating ``--alternations`` times; each cell is the best of ``--repeats`` timings of ``--calls`` forwards.

    python scripts/key_groups_bench.py
    python scripts/key_groups_bench.py --target /tmp/inflate_1b/1b-*/target --calls 3 --alternations 3

``docs/lab-notes/2026-11-29-flood.md`` has its figures (the embedded pair's target and the ``1b`` shape's).
"""

from __future__ import annotations

import argparse
import time

import torch

from specdec.assets import require_default_pair
from specdec.models import segments
from specdec.models.base import ForwardBatch
from specdec.models.loader import load_causal_lm

NEVER = 10**9
CASES = {
    "16 x 150": [150] * 16,
    "16 x 150 and 1 x 448": [150] * 16 + [448],
    "16 rows, 40-400": [40 + 24 * i for i in range(16)],
    "64 rows, 30-130": [30 + (i * 37) % 100 for i in range(64)],
    "64 rows, 30-400": [30 + (i * 37) % 370 for i in range(64)],
    "4 rows, 50-450": [50, 150, 300, 450],
}


def forward(lm, cache, lengths: list[int], tokens: int) -> None:
    """One forward of ``tokens`` tokens in every slot, each slot rolled back to its ``lengths`` entry first."""
    slots = list(range(len(lengths)))
    for slot, n in zip(slots, lengths):
        cache.set_length(slot, n)
    lm.forward(ForwardBatch.from_rows([[5] * tokens for _ in lengths], lengths, slots, lm.device), cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None, help="a model folder (default: the embedded pair's target)")
    parser.add_argument("--tokens", type=int, default=1, help="tokens each row feeds (1 + drafts)")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--alternations", type=int, default=2)
    cli = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    folder = cli.target or str(require_default_pair()[0])
    lm = load_causal_lm(folder, dtype=torch.float32, device=torch.device("cpu"), backend="fast")
    shipped = segments.SEGMENT_KEYS
    caches = {}
    for name, lengths in CASES.items():  # each case's contexts, fed once
        cache = lm.new_cache(len(lengths), max(lengths) + cli.tokens + 16)
        for slot, n in enumerate(lengths):
            context = [[(7 * i) % (lm.vocab_size - 5) + 5 for i in range(n)]]
            lm.forward(ForwardBatch.from_rows(context, [0], [slot], lm.device, logits="none"), cache)
        caches[name] = cache
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(cli.alternations):
        for threshold in (NEVER, shipped):
            segments.SEGMENT_KEYS = threshold
            for name, lengths in CASES.items():
                forward(lm, caches[name], lengths, cli.tokens)
                best = []
                for _ in range(cli.repeats):
                    start = time.perf_counter()
                    for _ in range(cli.calls):
                        forward(lm, caches[name], lengths, cli.tokens)
                    best.append((time.perf_counter() - start) / cli.calls * 1e3)
                times.setdefault((name, threshold), []).append(min(best))
    segments.SEGMENT_KEYS = shipped
    print(f"| rows (cached tokens) | one grid (ms) | key groups, {shipped} (ms) | groups |\n| --- | --- | --- | --- |")
    for name, lengths in CASES.items():
        needed = [n + cli.tokens for n in lengths]
        groups = [len(g) for g in segments.key_groups(needed, list(range(len(lengths))))]
        one, split = (", ".join(f"{t:.1f}" for t in times[(name, th)]) for th in (NEVER, shipped))
        print(f"| {name} | {one} | {split} | {groups} |")


if __name__ == "__main__":
    main()
