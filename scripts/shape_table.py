"""Issue 25's table: every method on the embedded pair inflated to a real shape (``bench --shape``),
at k 2, 4, 8 and auto, batch 1, 4 and 16, greedy and T = 0.7, as a few ``specdec bench`` runs under a
time budget. A benchmark for a quiet machine, not a test.

    python scripts/shape_table.py --part core          # batch 1, greedy, k 4 and auto: run this first
    python scripts/shape_table.py --part all --budget-minutes 240 --out runs/shape_table_1b

Parts, in order (``all`` runs them one after another while the budget lasts; a run that would
start past it is skipped and said so, a run still going at the end of the budget is stopped):

- ``core``:   batch 1, greedy, k 4 and auto;
- ``k``:      batch 1, greedy, k 2 and 8;
- ``batch``:  batch 4 and 16, greedy, k 2, 4, 8 and auto;
- ``sample``: batch 1, 4 and 16, T = 0.7, k 2, 4, 8 and auto.

Methods: plain, draft_model (the shape's draft), eagle (chain, and a tree of 4 candidates as
``eagle_tree``), medusa, mtp, ngram, suffix, lookahead, layer_skip (training-free; the trained
early exit as ``early_exit``), cascade (the embedded 3.6M draft drafting for the shape's draft, as
``cascade``), the embedded 3.6M draft alone (``small_draft``), auto. Each run writes
``OUT/<part>/bench.md`` and ``bench.json``; the command of each run is printed and kept in
``OUT/commands.txt``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from specdec.assets import require_default_pair

METHODS = "plain,draft_model,eagle,medusa,mtp,ngram,suffix,lookahead,layer_skip,cascade,auto"
"""The registered methods run; the labels of :func:`method_configs` other than cascade (a registered method that
runs only with its stages) run by themselves and must not be listed."""
PARTS = {
    "core": {"batch": ["1"], "k": ["4", "auto"], "temperature": "0"},
    "k": {"batch": ["1"], "k": ["2", "8"], "temperature": "0"},
    "batch": {"batch": ["4", "16"], "k": ["2", "4", "8", "auto"], "temperature": "0"},
    "sample": {"batch": ["1", "4", "16"], "k": ["2", "4", "8", "auto"], "temperature": "0.7"},
}


def method_configs() -> list[str]:
    """``--method-config`` values of the configurations beside the registered methods."""
    small = str(require_default_pair()[1])
    configs = {
        "eagle_tree": {"method": "eagle", "num_candidates": 4},
        "early_exit": {"method": "layer_skip", "early_exit": True},
        "small_draft": {"method": "draft_model", "model": small},
        "cascade": {"method": "cascade", "stages": [
            {"method": "draft_model", "model": small, "num_speculative_tokens": 2}, {"method": "draft_model"}]},
    }
    return [f"{name}={json.dumps(config)}" for name, config in configs.items()]


def command(part: str, args: argparse.Namespace) -> list[str]:
    spec = PARTS[part]
    cmd = [sys.executable, "-m", "specdec.cli", "bench", "--shape", args.shape, "--methods", METHODS,
           "--k", *spec["k"], "--batch-size", *spec["batch"], "--temperature", spec["temperature"],
           "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens),
           "--out", str(args.out / part)]
    for config in method_configs():
        cmd += ["--method-config", config]
    if args.shape_cache is not None:
        cmd += ["--shape-cache", str(args.shape_cache)]
    return cmd + args.extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1b", help="a bench --shape (default 1b; 8b on a GPU)")
    parser.add_argument("--part", choices=[*PARTS, "all"], default="core")
    parser.add_argument("--budget-minutes", type=float, default=120.0, help="stop starting runs after this")
    parser.add_argument("--num-prompts", type=int, default=8, help="held-out code prompts per run (default 8)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--shape-cache", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("runs/shape_table"))
    parser.add_argument("extra", nargs="*", help="further bench flags, after --")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_minutes * 60
    args.out.mkdir(parents=True, exist_ok=True)
    for part in PARTS if args.part == "all" else [args.part]:
        left = deadline - time.monotonic()
        if left <= 0:
            print(f"shape_table: budget spent, skipping part {part!r}", file=sys.stderr)
            continue
        cmd = command(part, args)
        line = shlex.join(cmd)
        print(f"shape_table: {line}", file=sys.stderr)
        with (args.out / "commands.txt").open("a") as f:
            f.write(line + "\n")
        try:
            subprocess.run(cmd, check=False, timeout=left)
        except subprocess.TimeoutExpired:
            print(f"shape_table: part {part!r} stopped at the end of the budget", file=sys.stderr)


if __name__ == "__main__":
    main()
