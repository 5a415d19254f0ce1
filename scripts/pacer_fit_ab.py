"""The prefill pacer of this checkout against the one of an earlier commit, interleaved: every method of
``bench-serve --in-process``'s workloads (default: code) runs under both pacers in each round (the order reversed every
other round), and the ratios to plain decoding are taken within a round under the same pacer (the flood's
p99 ITL against the same method without the flood, ``itl_p99_vs_baseline``, in the JSON). A benchmark,
not a test: ``docs/lab-notes/2026-11-28-pacer-fit.md`` used it with the default baseline (the pacer that priced a
prompt token against the mean step without prompts).

    python scripts/pacer_fit_ab.py --concurrency 16 64 --rounds 3 --json pacer_ab.json
    python scripts/pacer_fit_ab.py --shape 1b --shape-cache /tmp/inflate_1b --methods plain,draft_model,eagle \
        --concurrency 16 --num-requests 32 --max-step-time-ratio 1.25 --rounds 2

Flags other than this script's own go to ``bench-serve`` (its defaults otherwise, e.g. 1, 4, 16 and 64 streams).
The baseline's module is read with ``git show REV:src/specdec/prefill_pacer.py`` (so the repository's history
must be there) and given the scheduler's current ``observe(tokens, decoding, seconds, drafting, drafted)``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import types
from pathlib import Path

from specdec import scheduler as scheduler_module
from specdec.bench import serving
from specdec.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def baseline_pacer(rev: str) -> type:
    """The ``PrefillPacer`` of commit ``rev``, taking (and ignoring, if it predates them) the decoding tokens, the
    drafting seconds and the drafts verified."""
    source = subprocess.run(["git", "show", f"{rev}:src/specdec/prefill_pacer.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType(f"prefill_pacer_{rev}")
    exec(compile(source, module.__name__, "exec"), module.__dict__)  # noqa: S102 - the repository's own history
    pacer = module.PrefillPacer
    takes = pacer.observe.__code__.co_varnames[1:pacer.observe.__code__.co_argcount]  # after self

    class Baseline(pacer):
        def observe(self, tokens: int, decoding: int, seconds: float, drafting: float = 0.0, drafted: int = 0) -> None:
            given = {"tokens": tokens, "decoding": decoding, "seconds": seconds, "drafting": drafting,
                     "drafted": drafted}
            super().observe(*(given[name] for name in takes))

    return Baseline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="aadac41", help="the commit whose pacer is compared (default aadac41)")
    parser.add_argument("--methods", default="plain,eagle,draft_model,suffix", help="plain is needed for the ratios")
    parser.add_argument("--workloads", default="code", help="bench-serve workloads, comma-separated (default code)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write every row here")
    cli, rest = parser.parse_known_args()
    # every other flag is bench-serve's own: --concurrency, --num-requests, --shape, --max-step-time-ratio, ...
    args = build_parser().parse_args(["bench-serve", "--in-process", *rest])
    args.workloads = cli.workloads.split(",")
    pacers = {"this checkout": scheduler_module.PrefillPacer, cli.baseline: baseline_pacer(cli.baseline)}
    target, draft = serving.pair_folders(args)
    workloads, rows = None, []
    for r in range(1, cli.rounds + 1):
        order = list(pacers.items()) if r % 2 else list(pacers.items())[::-1]
        for method in cli.methods.split(","):
            for name, pacer in order:
                scheduler_module.PrefillPacer = pacer
                workloads, got = serving.run_method(method, args, workloads, target, draft, r)
                rows += [dict(g, pacer=name) for g in got]
    if cli.json:
        Path(cli.json).write_text(json.dumps(rows))
    for name in pacers:
        print(f"pacer of {name}:")
        print(serving.table(serving.compare([g for g in rows if g["pacer"] == name])))
    for method, workload, c in sorted({(g["method"], g["workload"], g["concurrency"]) for g in rows}):
        ratios = {"tokens_per_second": [], "ttft_ms_p50": [], "itl_ms_p99": []}
        for r in range(1, cli.rounds + 1):
            new, old = (next(g for g in rows if (g["method"], g["workload"], g["concurrency"], g["round"], g["pacer"])
                             == (method, workload, c, r, name)) for name in pacers)
            for key, values in ratios.items():
                values.append(new[key] / old[key])
        print(f"{method}, {workload}, {c} streams, this checkout / {cli.baseline}, medians: "
              + ", ".join(f"{key} {statistics.median(v):.2f}" for key, v in ratios.items()))


if __name__ == "__main__":
    main()
