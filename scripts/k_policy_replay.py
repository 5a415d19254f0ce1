"""Auto k's decisions and steps in serving runs, recorded and replayed: ``record`` runs ``bench-serve --in-process``
(the code workload, one method) several times and writes every :class:`specdec.adaptive.AdaptiveK` decision and
observed step to a JSON file a run; ``replay`` feeds those steps, open-loop, to a fresh policy of each variant and
counts, at each decision at one row of the measured requests, whether one draft is priced over the bound (with the
calibration: what decides; without it: what refuses a probe while speculation is off); ``widths`` compares, per draft
width, the error of the one drafting calibration every width shares with that of a calibration per width. A
diagnostic, not a test: ``docs/lab-notes/2026-12-01-pace.md`` and ``2026-12-01-widths.md`` used it.

    python scripts/k_policy_replay.py record --runs 20 --out /tmp/traces --shape 1b --shape-cache /tmp/inflate_1b \\
        --method draft_model --concurrency 1 --num-requests 8 --max-tokens 32 --max-step-time-ratio 1.25
    python scripts/k_policy_replay.py replay /tmp/traces/*.json
    python scripts/k_policy_replay.py widths /tmp/traces/*.json

Variants: ``pace`` (this checkout: each step enters its calibration at the host's pace, :class:`specdec.step_cost.Pace`)
and ``apart`` (each kind of step calibrated on its own steps alone, as until 2026-12-01).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from backlog_ab import own_steps

from specdec.adaptive import GUARD_EVIDENCE, AdaptiveK
from specdec.metrics import RequestMetrics
from specdec.step_cost import Calibration, Pace, StepCost

CALIBRATE = Pace.calibrate
VARIANTS = {"pace": CALIBRATE, "apart": own_steps}


def record(cli: argparse.Namespace, rest: list[str]) -> None:
    """``cli.runs`` runs of one method, each written to ``cli.out/run-N.json``."""
    from specdec.bench import serving
    from specdec.cli import build_parser

    events: list[dict] = []
    phase = {"measured": False}
    choose, observe, warm_up = AdaptiveK.choose, AdaptiveK.observe, serving.warm_up

    def traced_choose(policy, seqs, limits, backlog=None, prompt_tokens=0, prompt_backlog=0):
        ks = choose(policy, seqs, limits, backlog, prompt_tokens, prompt_backlog)
        events.append({"choose": [s.request_id for s in seqs], "limits": limits, "prompt_tokens": prompt_tokens,
                       "prompt_backlog": prompt_backlog, "ks": list(ks), "joining": policy.joining,
                       "measured": phase["measured"]})
        return ks

    def traced_observe(policy, seqs, num_drafted, num_accepted, step):
        if not events or "policy" not in events[0]:
            events.insert(0, {"policy": {"max_k": policy.max_k, "padded": policy.padded,
                                         "max_step_ratio": policy.max_step_ratio}})
        events.append({"observe": [s.request_id for s in seqs], "drafted": list(num_drafted),
                       "accepted": list(num_accepted), "step": asdict(step)})
        observe(policy, seqs, num_drafted, num_accepted, step)

    def traced_warm_up(*args, **kwargs):
        phase["measured"] = False
        warm_up(*args, **kwargs)
        phase["measured"] = True

    AdaptiveK.choose, AdaptiveK.observe, serving.warm_up = traced_choose, traced_observe, traced_warm_up
    args = build_parser().parse_args(["bench-serve", "--in-process", *rest])
    args.workloads = ["code"]
    target, draft = serving.pair_folders(args)
    out = Path(cli.out)
    out.mkdir(parents=True, exist_ok=True)
    workloads = None
    for run in range(cli.runs):
        events.clear()
        workloads, rows = serving.run_method(cli.method, args, workloads, target, draft)
        (out / f"run-{run}.json").write_text(json.dumps({"row": rows[-1], "events": list(events)}))


@dataclass
class Row:
    """A sequence as the policy sees it in a replay."""

    request_id: str
    metrics: RequestMetrics = field(default_factory=RequestMetrics)


def feed(path: Path) -> Iterator[tuple[AdaptiveK, list[Row], dict]]:
    """One trace fed open-loop to a fresh policy: yields ``(policy, seqs, event)`` for every event, an observed step
    before the policy observes it, a decision after the policy made it (then set to what the run did)."""
    events = json.loads(path.read_text())["events"]
    policy = AdaptiveK(**events[0]["policy"])
    rows: dict[str, Row] = {}
    for event in events[1:]:
        seqs = [rows.setdefault(i, Row(i)) for i in event.get("choose") or event.get("observe")]
        if "observe" in event:
            yield policy, seqs, event
            policy.observe(seqs, event["drafted"], event["accepted"], StepCost(**event["step"]))
            continue
        policy.choose(seqs, event["limits"], None, event["prompt_tokens"], event["prompt_backlog"])
        policy.asked, policy.joining = event["ks"], event["joining"]  # open loop: what the run did
        yield policy, seqs, event


def replay(path: Path, variant: str) -> dict[str, int]:
    """One trace fed open-loop to a fresh policy of ``variant``: decisions at one row in the measured requests,
    how many priced one draft over the bound with and without the calibration, and the longest stretch of
    decisions in a row so priced (with it)."""
    Pace.calibrate = VARIANTS[variant]
    try:
        counts = {"decisions": 0, "over": 0, "over_uncalibrated": 0, "longest": 0}
        stretch = 0
        for policy, seqs, event in feed(path):
            if "observe" in event:
                continue
            model = policy._model(1) if len(seqs) == 1 else None
            if model is None or not event["measured"] or not event["limits"][0]:
                continue
            scale = policy.drafting_scale(1) or 1.0
            bound = policy.max_step_ratio
            over = replace(model, drafting_scale=scale).left_in_bound(bound, 1, 2, 1) < 0
            counts["decisions"] += 1
            counts["over"] += over
            counts["over_uncalibrated"] += model.left_in_bound(bound, 1, 2, 1) < 0
            stretch = stretch + 1 if over else 0
            counts["longest"] = max(counts["longest"], stretch)
        return counts
    finally:
        Pace.calibrate = CALIBRATE


def width_errors(path: Path) -> dict[int, tuple[list[float], list[float]]]:
    """One trace fed open-loop to a fresh policy of this checkout: for each drafting step at one row whose calibration
    applied (``GUARD_EVIDENCE``), by its width, ``log(measured / calibrated prediction)`` with the one drafting
    calibration every width shares, and with a calibration of that width's steps alone (the shared one until the
    width has ``GUARD_EVIDENCE`` of its own)."""
    errors: dict[int, tuple[list[float], list[float]]] = {}
    per_width: dict[int, Calibration] = {}
    at: dict = {"width": 0, "policy": None}  # the step being observed (width 0: not one row drafting), the policy

    def calibrate(pace: Pace, kind: Calibration, measured: float, predicted: float) -> None:
        if at["width"] and kind is at["policy"].calibration[1][1]:
            seen = measured / (pace.value or 1.0) / predicted  # as the kind's calibration takes it
            own = per_width.setdefault(at["width"], Calibration(kind.decay))
            if kind.weight >= GUARD_EVIDENCE:
                shared, apart = errors.setdefault(at["width"], ([], []))
                shared.append(math.log(seen / kind.ratio()))
                apart.append(math.log(seen / (own if own.weight >= GUARD_EVIDENCE else kind).ratio()))
            own.add(measured / (pace.value or 1.0), predicted)
        CALIBRATE(pace, kind, measured, predicted)

    Pace.calibrate = calibrate
    try:
        for policy, seqs, event in feed(path):
            if "observe" in event:
                at["width"] = event["step"]["width"] if len(seqs) == 1 else 0
                at["policy"] = policy
        return errors
    finally:
        Pace.calibrate = CALIBRATE


def print_width_errors(traces: list[str]) -> None:
    """:func:`width_errors` over ``traces``: per width, the steps, and the mean and root mean square of the log
    error with the shared calibration and with one per width."""
    totals: dict[int, tuple[list[float], list[float]]] = {}
    for trace in traces:
        for w, (shared, apart) in width_errors(Path(trace)).items():
            totals.setdefault(w, ([], []))[0].extend(shared)
            totals[w][1].extend(apart)
    print("width | steps | shared: mean, rms | per width: mean, rms")
    for w, errors in sorted(totals.items()):
        cells = [f"{statistics.fmean(e):+.3f}, {math.sqrt(statistics.fmean(x * x for x in e)):.3f}" for e in errors]
        print(f"{w} | {len(errors[0])} | " + " | ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="bench-serve runs with every decision and step written (other flags go to "
                                        "bench-serve)")
    rec.add_argument("--runs", type=int, default=10)
    rec.add_argument("--out", required=True, help="a folder for run-N.json")
    rec.add_argument("--method", default="draft_model")
    rep = sub.add_parser("replay", help="replay traces through each variant")
    rep.add_argument("traces", nargs="+")
    rep.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    wid = sub.add_parser("widths", help="the drafting calibration's error by draft width, shared or per width")
    wid.add_argument("traces", nargs="+")
    cli, rest = parser.parse_known_args()
    if cli.command == "record":
        record(cli, rest)
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if cli.command == "widths":
        print_width_errors(cli.traces)
        return
    totals = {v: {"decisions": 0, "over": 0, "over_uncalibrated": 0, "longest": 0} for v in cli.variants}
    print("trace | tok/s | " + " | ".join(f"{v}: over, uncalibrated, longest" for v in cli.variants))
    for trace in cli.traces:
        path = Path(trace)
        row = json.loads(path.read_text())["row"]
        cells = []
        for variant in cli.variants:
            counts = replay(path, variant)
            cells.append(f"{counts['over']}/{counts['decisions']}, {counts['over_uncalibrated']}, {counts['longest']}")
            for key, value in counts.items():
                totals[variant][key] = max(totals[variant][key], value) if key == "longest" else \
                    totals[variant][key] + value
        print(f"{path.name} | {row['tokens_per_second']:.1f} | " + " | ".join(cells))
    print("all | | " + " | ".join(f"{t['over']}/{t['decisions']}, {t['over_uncalibrated']}, {t['longest']}"
                                  for t in totals.values()))


if __name__ == "__main__":
    main()
