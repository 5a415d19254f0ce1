"""This checkout's rules for auto k (one or several) against the rules before them, interleaved round by round
(:mod:`specdec.bench.interleaved`). A benchmark, not a test: ``docs/lab-notes/2026-11-30-queue-and-probes.md``
used it.

- ``--change queue``: auto k drafts nothing only while prompt tokens wait past the next step (a queue), against
  drafting nothing while any wait past this step (``Scheduler._backlog`` as it was).
- ``--change probe``: a probe while speculation is off waits for a step that feeds no prompt tokens
  (``AdaptiveK._may_probe``), against probing on the step it is due.
- ``--change catch-up``: under a bound, every step's drafting rows are cut to those whose drafters catch up within
  ``CATCH_UP_BUDGET`` positions a row, the least behind always (``AdaptiveK._caps``), against cutting only a probe's.
- ``--change within-bound``: under a bound, the rows joining the drafting are budgeted in seconds (what the bound
  leaves of the step, at the drafter's measured seconds per position caught up on: ``CatchUpRate``) and a probe
  whose cheapest form is predicted over the bound is not taken (``AdaptiveK._cheapest_fits``), against
  ``CATCH_UP_BUDGET`` positions a row and every probe taken.
- ``--change prompt-bound``: under a bound, a drafting step's prompt tokens count in the step the bound applies to
  (``specdec.k_choice``), against bounding the step without them (``choose_ks`` as of commit ``483227f``, read
  from git).
- ``--change fold``: a draft model whose drafting rows are a few positions behind feeds their backlog in its
  proposal's first forward (``DraftModelDrafter._folds``), against a catch-up forward of its own for every backlog
  of more than two tokens a row.
- ``--change probe-catch-up``: under a bound, a probe while speculation is off is taken where its cheapest form
  (one row, one position) is predicted within the bound, its catch-up left out (``AdaptiveK._cheapest_fits``),
  against pricing the catch-up of the row least behind at the measured rate (as of commit ``5794778``).
- ``--change hiccup``: the calibration counts a step as at most ``HICCUP`` times what it expected of it
  (``step_cost.Calibration``), against up to ``OUTLIER`` times the mean step of its kind so far.
- ``--change shape-hiccup``: a step counts in its shape's mean as at most ``HICCUP`` times that mean
  (``AdaptiveK.observe``), against in full.
- ``--change pace``: each step enters its kind's calibration at the host's pace (``step_cost.Pace``), against each
  kind calibrated on its own steps alone.

Several changes given together are installed together (``--change probe-catch-up hiccup``).

    python scripts/backlog_ab.py --change probe --shape 1b --shape-cache /tmp/inflate_1b \\
        --methods plain,eagle,draft_model --concurrency 16 64 --num-requests 128 --max-tokens 32 \\
        --max-step-time-ratio 1.25 --rounds 2

``--control`` runs this checkout under both names instead (an A/A control). Flags other than this script's own go
to ``bench-serve``.
"""

from __future__ import annotations

import math
import subprocess
from functools import cache

from specdec import adaptive
from specdec.adaptive import AdaptiveK
from specdec.bench import interleaved
from specdec.catch_up import CatchUpRate
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.scheduler import Scheduler
from specdec.step_cost import HICCUP, OUTLIER, Calibration, Pace

BACKLOG, MAY_PROBE, CAPS = Scheduler._backlog, AdaptiveK._may_probe, AdaptiveK._caps
RATE, FITS, CHOOSE = CatchUpRate.per_position, AdaptiveK._cheapest_fits, adaptive.choose_ks
FOLDS, CHOOSE_POLICY, CALIBRATE = DraftModelDrafter._folds, AdaptiveK.choose, Calibration.add
AT_PACE = Pace.calibrate
BEFORE = "483227f"  # the last commit whose bound left a step's prompt tokens out


@cache
def choose_before():
    """``choose_ks`` as it was at ``BEFORE`` (read and compiled once, not at every install)."""
    source = subprocess.run(["git", "show", f"{BEFORE}:src/specdec/k_choice.py"], capture_output=True, text=True,
                            check=True).stdout
    namespace: dict = {}
    exec(compile(source, f"k_choice@{BEFORE}", "exec"), namespace)  # noqa: S102 - this repository's own history
    return namespace["choose_ks"]


def any_left(self, chunks):
    """The prompt tokens left after this step's chunks: the queue as it was (every one turned the drafts off)."""
    return sum(self._left(seq) - chunk for seq, chunk in zip(self.prefilling, chunks))


def when_due(self, ks, prompt_tokens):
    """A probe on the step it is due, prompts fed or not."""
    return True


def probes_only(self, probing):
    """Only a probe's rows are cut to those catching up within the budget."""
    return probing


def unmeasured(self):
    """The seconds per position caught up on never measured: the budget stays in positions."""
    return None


def always(self, rows, model):
    """Every probe that is due is taken."""
    return True


def apart(self, seqs):
    """No backlog fed by the proposal: a catch-up forward of its own for every row more than two tokens behind."""
    return False


def choose_keeping_backlog(self, seqs, limits, backlog=None, *args, **kwargs):
    """``AdaptiveK.choose``, the step's rows and backlog kept for :func:`catch_up_priced`."""
    self.step_seqs, self.step_backlog = seqs, backlog
    return CHOOSE_POLICY(self, seqs, limits, backlog, *args, **kwargs)


def catch_up_priced(self, rows, model):
    """A probe's cheapest form fits with the catch-up of the row least behind at the measured rate besides."""
    if self.max_step_ratio is None:
        return True
    rate, backlog = self.catch_up.per_position(), self.step_backlog
    catch_up = rate * min(backlog(self.step_seqs)) if rate is not None and backlog is not None else 0.0
    return model.left_in_bound(self.max_step_ratio, rows, self._fed([1] + [0] * (rows - 1)), 1) >= catch_up


def in_full(self, measured, predicted):
    """The calibration as it was: a step counts as at most ``OUTLIER`` times the mean step of its kind so far."""
    if self.weight:
        measured = min(measured, OUTLIER * self.measured / self.weight)
    self.weight = self.weight * self.decay + 1.0
    self.measured = self.measured * self.decay + measured
    self.predicted = self.predicted * self.decay + predicted


def own_steps(self, kind, measured, predicted):
    """Each kind of step calibrated on its own steps alone, whenever they ran (no pace)."""
    kind.add(measured, predicted)


def install(changes: list[str], new: bool) -> None:
    """Patch the scheduler or the policy for the runs that follow: this checkout's rules where ``new``, else the
    rules before ``changes``."""
    old = set() if new else set(changes)
    Scheduler._backlog = any_left if "queue" in old else BACKLOG
    AdaptiveK._may_probe = when_due if "probe" in old else MAY_PROBE
    AdaptiveK._caps = probes_only if "catch-up" in old else CAPS
    CatchUpRate.per_position = unmeasured if "within-bound" in old else RATE
    AdaptiveK._cheapest_fits = always if "within-bound" in old else catch_up_priced if "probe-catch-up" in old else FITS
    AdaptiveK.choose = choose_keeping_backlog if "probe-catch-up" in old else CHOOSE_POLICY
    adaptive.choose_ks = choose_before() if "prompt-bound" in old else CHOOSE
    DraftModelDrafter._folds = apart if "fold" in old else FOLDS
    Calibration.add = in_full if "hiccup" in old else CALIBRATE
    adaptive.HICCUP = math.inf if "shape-hiccup" in old else HICCUP
    Pace.calibrate = own_steps if "pace" in old else AT_PACE


def main() -> None:
    parser = interleaved.arguments(__doc__.split("\n\n")[0], rounds=2)
    parser.add_argument("--change", required=True, nargs="+",
                        choices=("queue", "probe", "catch-up", "within-bound", "prompt-bound", "fold",
                                 "probe-catch-up", "hiccup", "shape-hiccup", "pace"))
    cli, rest = parser.parse_known_args()
    interleaved.main(cli, rest, {"new": lambda: install(cli.change, True), "old": lambda: install(cli.change, False)})


if __name__ == "__main__":
    main()
