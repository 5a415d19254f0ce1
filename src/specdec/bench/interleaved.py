"""Two variants of the server's code compared side by side: ``bench-serve --in-process``'s methods run under
each variant in every round (the order reversed every other round, as the host drifts), and each method's ratios
to plain decoding are taken within a round under the same variant, then the variants' rows are compared round by
round. A variant is a name and a function that installs it (patches a module for the runs that follow) before each
of its runs; an A/A control (``--control``) runs the first variant's installer under both names, to show how far the
host's noise alone moves the ratios. Used by ``scripts/pacer_fit_ab.py``,
``scripts/queue_weight_ab.py`` and ``scripts/backlog_ab.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specdec.bench import serving

RATIOS = ("tokens_per_second", "ttft_ms_p50", "itl_ms_p99")
"""The figures compared between the variants, each as the first variant's over the second's."""


def run_rounds(variants: dict[str, Callable[[], None]], methods: list[str], args, rounds: int, target: Path,
               draft: Path) -> list[dict[str, Any]]:
    """Every method under every variant, ``rounds`` times, on the pair ``target``, ``draft``; returns bench-serve's
    rows, each with its ``variant`` and ``round``."""
    workloads, rows = None, []
    for r in range(1, rounds + 1):
        order = list(variants.items()) if r % 2 else list(variants.items())[::-1]
        for method in methods:
            for name, install in order:
                install()
                workloads, got = serving.run_method(method, args, workloads, target, draft, r)
                rows += [dict(g, variant=name) for g in got]
    return rows


def report(rows: list[dict[str, Any]], names: list[str], rounds: int) -> str:
    """Each variant's comparison with plain decoding (bench-serve's table, medians over the rounds), then per
    method, workload and concurrency the medians over the rounds of the first variant's figures over the
    second's (:data:`RATIOS`)."""
    lines = []
    for name in names:
        lines += [f"{name}:", serving.table(serving.compare([g for g in rows if g["variant"] == name]))]
    first, second = names
    for method, workload, c in sorted({(g["method"], g["workload"], g["concurrency"]) for g in rows}):
        ratios: dict[str, list[float]] = {key: [] for key in RATIOS}
        for r in range(1, rounds + 1):
            new, old = (next(g for g in rows if (g["method"], g["workload"], g["concurrency"], g["round"],
                                                 g["variant"]) == (method, workload, c, r, name))
                        for name in (first, second))
            for key, values in ratios.items():
                values.append(new[key] / old[key])
        lines.append(f"{method}, {workload}, {c} streams, {first} / {second}, medians: "
                     + ", ".join(f"{key} {statistics.median(v):.2f}" for key, v in ratios.items()))
    return "\n".join(lines)


def arguments(description: str, rounds: int) -> argparse.ArgumentParser:
    """The flags of a script built on this module (``--methods``, ``--workloads``, ``--rounds``, ``--json``,
    ``--control``); the script adds its own, and every other flag is bench-serve's (``--concurrency``, ``--shape``,
    ...)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--methods", default="plain,eagle,draft_model,suffix", help="plain is needed for the ratios")
    parser.add_argument("--workloads", default="code", help="bench-serve workloads, comma-separated (default code)")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--json", default=None, help="also write every row here, with the settings and where it ran")
    parser.add_argument("--control", action="store_true",
                        help="the first variant under every name (an A/A control: the host's noise alone)")
    return parser


def main(cli: argparse.Namespace, rest: list[str], variants: dict[str, Callable[[], None]]) -> None:
    """Run ``variants`` with the script's flags ``cli`` (of :func:`arguments`) and bench-serve's ``rest``; write the
    rows to ``--json`` if given (``{"settings", "environment", "rows"}``, as :func:`specdec.bench.serving.record`)
    and print :func:`report`. With ``--control`` every name runs the first variant."""
    from specdec.cli import build_parser

    args = build_parser().parse_args(["bench-serve", "--in-process", *rest])
    args.workloads = cli.workloads.split(",")
    args.methods, args.rounds, args.json = cli.methods, cli.rounds, cli.json  # the record's settings say what ran
    if cli.control:
        first = next(iter(variants.values()))
        variants = dict.fromkeys(variants, first)
    target, draft = serving.pair_folders(args)
    rows = run_rounds(variants, cli.methods.split(","), args, cli.rounds, target, draft)
    if cli.json:
        Path(cli.json).write_text(json.dumps({**serving.record(args, target), "rows": rows}))
    print(report(rows, list(variants), cli.rounds))
