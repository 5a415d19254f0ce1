"""An experiment that was not adopted: a prefill pacer that bounds the running streams' time per token against
plain decoding's step instead of the speculative step's own time, run interleaved with the shipped pacer on
``bench-serve --in-process``'s code workload. A benchmark, not a test: ``docs/lab-notes/2026-11-28-rounds.md``.

The shipped pacer (:mod:`specdec.prefill_pacer`) keeps a step that feeds prompt tokens within ``1 + SHARE``
times the decoding step measured without them. Here a speculative method's step may instead take ``(1 + SHARE)
* a_plain * m`` seconds, ``a_plain`` the policy's calibrated plain step for the rows running and ``m`` the tokens
a row gets per step (decayed): the streams' time per token stays within ``1 + SHARE`` plain steps, and the
headroom speculation leaves goes to the prompts.

    python scripts/pacer_plain_reference.py --methods eagle,suffix,draft_model --concurrency 16 64 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics

from specdec import prefill_pacer
from specdec import scheduler as scheduler_module
from specdec.adaptive import AdaptiveK
from specdec.bench import serving
from specdec.cli import build_parser

STATE: dict = {"on": False, "reference": None, "tokens_per_row": None}


def wrap() -> None:
    """Let the pacer's budget grow to the plain-referenced one while ``STATE["on"]``."""
    budget, step = prefill_pacer.PrefillPacer.budget, scheduler_module.Scheduler.step

    def referenced_budget(self, cap, running):
        base = budget(self, cap, running)
        reference, line = STATE["reference"], self.line()
        if not STATE["on"] or not running or base == 0 or line is None or reference is None:
            return base
        a, b = line
        chunk = int(((1 + prefill_pacer.SHARE) * reference - a) / b) if b > 0 else cap
        return max(base, min(cap, chunk))

    def referenced_step(self):
        policy, rows = self.engine.policy, len(self.running)
        STATE["reference"] = None
        if isinstance(policy, AdaptiveK) and rows and STATE["tokens_per_row"]:
            model = policy.cost_model(rows)
            if model is not None:
                plain = model.target_seconds(rows)
                calibration = policy.calibration.get(rows)
                if calibration is not None and calibration[0].weight > 0:
                    plain *= calibration[0].ratio()
                STATE["reference"] = plain * STATE["tokens_per_row"]
        out = step(self)
        if out:
            m = sum(len(o.token_ids) for o in out) / len(out)
            old = STATE["tokens_per_row"]
            STATE["tokens_per_row"] = m if old is None else 0.9 * old + 0.1 * m
        return out

    prefill_pacer.PrefillPacer.budget = referenced_budget
    scheduler_module.Scheduler.step = referenced_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="eagle,suffix,draft_model")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--rounds", type=int, default=2)
    cli = parser.parse_args()
    # bench-serve's own settings (its defaults), the code workload only
    args = build_parser().parse_args(["bench-serve", "--in-process", "--concurrency",
                                      *map(str, cli.concurrency)])
    args.workloads = ["code"]
    wrap()
    target, draft = serving.pair_folders(args)
    workloads, rows = None, []
    for r in range(1, cli.rounds + 1):
        order = (False, True) if r % 2 else (True, False)
        for method, on in [("plain", False)] + [(m, on) for m in cli.methods.split(",") for on in order]:
            STATE.update(on=on, tokens_per_row=None)
            workloads, got = serving.run_method(method, args, workloads, target, draft, r)
            rows += [dict(g, method=f"{method}, {'plain-referenced' if on else 'shipped'} pacer")
                     if method != "plain" else g for g in got]
    print(serving.table(serving.compare(rows)))  # medians over the rounds, each ratio within its round
    plain = {(g["round"], g["concurrency"]): g["ttft_ms_p50"] for g in rows if g["method"] == "plain"}
    ttft: dict = {}
    for g in rows:
        if g["method"] != "plain":
            ttft.setdefault((g["method"], g["concurrency"]), []).append(
                g["ttft_ms_p50"] / plain[(g["round"], g["concurrency"])])
    for (method, c), values in sorted(ttft.items()):
        print(f"{method}, {c} streams: TTFT p50 / plain {statistics.median(values):.2f}")


if __name__ == "__main__":
    main()
