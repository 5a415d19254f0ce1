"""Where a serving benchmark's time goes, step by step: ``bench-serve --in-process``'s code workload (or, with
``--workload flood``, the flood workload: its rows alone and then flooded, one summary of the flooded row) at one
concurrency, each method in turn, with every scheduler step timed and split (the target's forward, the prompt
chunks' share of it, prompts fed in forwards of their own, drafting, the drafter's start on prompts that
finished feeding), the rows decoding and being fed, and the prefill pacer's measured step ``a`` and
per-token cost ``b``. A benchmark, not a test: ``docs/lab-notes/2026-11-28-rounds.md`` used it.

    python scripts/serving_step_trace.py --methods plain,eagle --concurrency 16
    python scripts/serving_step_trace.py --shape 1b --shape-cache /tmp/inflate_1b --methods plain,draft_model \\
        --concurrency 16 --num-requests 32 --max-step-time-ratio 1.25
    python scripts/serving_step_trace.py --shape 1b --shape-cache /tmp/inflate_1b --methods plain,draft_model \
        --request-rate 0.3 --num-requests 32 --max-step-time-ratio 1.25
    python scripts/serving_step_trace.py --workload flood --methods plain --concurrency 1 --min-paced-chunk 16 \\
        --json /tmp/flood.json

``--json`` keeps every step (seconds, rows decoding and being fed, prompt tokens fused, the pacer's ``a`` and
``b``; ``at``: its start on ``time.perf_counter``, so that time between steps shows; ``cpu``: the process's CPU
seconds in it, all threads, so that a step the machine took the cores from shows; ``gc``: the collector's pauses
in it), from which ``docs/lab-notes/2026-11-29-flood.md`` grouped the flood's steps by rows and prompt tokens.

Wraps ``Scheduler.step`` and three ``Engine`` methods for the run (nothing is changed for good). The
summary covers the measured requests (from the first step with two sequences; the warm-up runs one).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

from specdec import engine as engine_module
from specdec import prefill_pacer
from specdec import prompt_feed as prompt_feed_module
from specdec import scheduler as scheduler_module
from specdec.bench import serving
from specdec.cli import build_parser

STEPS: list[dict] = []
CURRENT: dict = {}
GC_PAUSES: list[float] = []
"""The garbage collector's pauses (seconds) since the current step began."""


def collector(phase: str, info: dict) -> None:
    """``gc.callbacks`` hook: each collection's pause into ``GC_PAUSES``."""
    if phase == "start":
        GC_PAUSES.append(-time.perf_counter())
    elif GC_PAUSES:
        GC_PAUSES[-1] += time.perf_counter()


def wrap() -> None:
    """Time every scheduler step into ``STEPS`` (the engine's parts into ``CURRENT`` while it runs)."""
    step, start, record, feeding = (scheduler_module.Scheduler.step, prompt_feed_module.PromptFeed.start_drafter,
                                    engine_module.Engine._record, engine_module.Engine.step_feeding)

    def timed_step(self):
        CURRENT.clear()
        CURRENT.update(running=len(self.running), prefilling=len(self.prefilling), start=0.0, fed=0)
        GC_PAUSES.clear()
        tic, cpu = time.perf_counter(), time.process_time()
        out = step(self)
        if out:
            line = self.pacer.line() if self.pacer else None
            STEPS.append(dict(CURRENT, seconds=time.perf_counter() - tic, a=line[0] if line else None,
                              b=line[1] if line else None, drafted=sum(o.num_drafted for o in out),
                              at=tic, cpu=time.process_time() - cpu, gc=sum(p for p in GC_PAUSES if p > 0)))
        return out

    def timed_start(self, ready):
        tic = time.perf_counter()
        start(self, ready)
        CURRENT["start"] = CURRENT.get("start", 0.0) + time.perf_counter() - tic

    def kept_times(self, seqs, outputs, times):
        for key, value in times.items():
            CURRENT[key] = CURRENT.get(key, 0.0) + value
        return record(self, seqs, outputs, times)

    def counted_feeding(self, seqs, prompts, chunks, prompt_backlog=0):
        CURRENT["fed"] = sum(chunks or ()) if prompts else 0
        return feeding(self, seqs, prompts, chunks, prompt_backlog)

    gc.callbacks.append(collector)
    scheduler_module.Scheduler.step = timed_step
    prompt_feed_module.PromptFeed.start_drafter = timed_start
    engine_module.Engine._record = kept_times
    engine_module.Engine.step_feeding = counted_feeding


def summary(method: str, row: dict, steps: list[dict]) -> str:
    first = next((i for i, s in enumerate(steps) if s["running"] + s["prefilling"] >= 2), 1)
    steps = steps[max(first - 1, 0):]
    total = {key: sum(s.get(key, 0.0) for s in steps) for key in ("seconds", "target", "prefill", "drafting", "start")}
    a = [s["a"] for s in steps if s["a"]]
    b = [s["b"] for s in steps if s["b"]]
    pacer = (f"pacer a {statistics.median(a) * 1e3:.1f} ms, b {statistics.median(b) * 1e3:.3f} ms a token"
             if a and b else "pacer unused")
    rows = statistics.fmean(s["running"] for s in steps)
    fed = statistics.fmean(s["prefilling"] for s in steps)
    return (f"{method:<11} {row['tokens_per_second']:.1f} tok/s, TTFT p50 {row['ttft_ms_p50']:.0f} ms | "
            f"{len(steps)} steps,"
            f" {total['seconds']:.2f} s: target {total['target']:.2f}, prompt chunks {total['prefill']:.2f},"
            f" drafting {total['drafting']:.2f}, drafter start {total['start']:.2f} | rows decoding "
            f"{rows:.1f}, being fed {fed:.1f}, prompt tokens fused {sum(s['fed'] for s in steps)},"
            f" drafted {sum(s['drafted'] for s in steps)} | {pacer}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="plain,eagle", help="comma-separated bench-serve methods")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--request-rate", type=float, default=None,
                        help="an open loop at this many requests a second instead (the code workload)")
    parser.add_argument("--num-requests", type=int, default=None, help="default: bench-serve's (2 x concurrency)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-step-time-ratio", type=float, default=None)
    parser.add_argument("--shape", default=None, help="an inflated shape (1b, ...); default the embedded pair")
    parser.add_argument("--shape-cache", default=None)
    parser.add_argument("--json", default=None, help="also write every step here")
    parser.add_argument("--workload", choices=("code", "flood"), default="code")
    parser.add_argument("--prefill-share", type=float, default=None, help="the engine's prefill_share (default 0.5)")
    parser.add_argument("--min-paced-chunk", type=int, default=None,
                        help=f"the prefill pacer's floor for this run (default {prefill_pacer.MIN_PACED_CHUNK})")
    cli = parser.parse_args()
    if cli.min_paced_chunk is not None:
        prefill_pacer.MIN_PACED_CHUNK = cli.min_paced_chunk
    # bench-serve's own settings (its defaults, these flags), the code workload only
    flags = {"--num-requests": cli.num_requests, "--max-step-time-ratio": cli.max_step_time_ratio,
             "--shape": cli.shape, "--shape-cache": cli.shape_cache, "--request-rate": cli.request_rate,
             "--prefill-share": cli.prefill_share}
    args = build_parser().parse_args(["bench-serve", "--in-process", "--concurrency", str(cli.concurrency),
                                      "--max-tokens", str(cli.max_tokens),
                                      *[x for flag, v in flags.items() if v is not None for x in (flag, str(v))]])
    args.workloads = [cli.workload]
    wrap()
    target, draft = serving.pair_folders(args)
    workloads, runs = None, []
    for method in cli.methods.split(","):
        STEPS.clear()
        workloads, rows = serving.run_method(method, args, workloads, target, draft)
        runs.append((method, rows[-1], list(STEPS)))  # the flood's last row is the flooded one
    for method, row, steps in runs:
        print(summary(method, row, steps))
    if cli.json:
        with open(cli.json, "w") as f:
            json.dump([{"method": m, "row": r, "steps": s} for m, r, s in runs], f)


if __name__ == "__main__":
    main()
