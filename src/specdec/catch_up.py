"""Which rows draft on a step where their drafters have something to catch up: :func:`least_behind`, used by
auto k (:class:`specdec.adaptive.AdaptiveK`) on a probe while speculation is off and, under a bound on a drafting
step's time, on every drafting step.

Terms. A row's ``backlog`` (:meth:`specdec.drafters.base.Drafter.backlog`) is the positions its drafter feeds its
own model before its first draft: a draft model's slot falls behind by every token emitted while the row does not
draft (and is fed the prompt at the row's first draft), an EAGLE layer buffers every target feature, the prompt's
included, and back from a pause feeds the last ``catch_up_window`` of them
(:class:`~specdec.drafters.heads.eagle.EagleDrafter`). A row *drafting* drafted on its previous step: its backlog
is what that step committed (the pending token and the accepted drafts), the steady feed that a drafting step's
measured time includes. The others *join*: their catch-up is a cost of switching, paid once, that auto k leaves
out of a step's price (:mod:`specdec.adaptive`).

The rule. The rows drafting keep their drafts. Of the rows joining, the least behind joins always (ties: the
earlier row), and the next least behind as long as the joining rows' backlogs add up to at most
``CATCH_UP_BUDGET`` positions per row of the step. The others draft nothing this step and join on a later one.

The budget in seconds. Under a bound, once the drafter's seconds per position caught up on are measured
(:class:`CatchUpRate`, on the drafting steps that rows joined), the budget is what the bound leaves of the step's
predicted time with the rows drafting alone, and a joining row costs its backlog at that rate and the tokens its
draft adds to the target's forward (none on a padded grid, whose width the budget already pays):
:func:`seconds_budget`. Positions are a poor unit for it: at 64 streams at the ``1b`` shape on a 2-core CPU the 4
positions a row of 64 rows let probes join 11-16 rows, 0.10-0.12 s of drafting, mostly catch-up, on top of a
target's forward that one draft had already widened, and such probes took 1.5-1.9 plain steps against a bound of
1.25. A probe whose cheapest form (one row, one position; its catch-up, a cost of switching, not priced) is predicted
over the bound is not taken at all (:mod:`specdec.adaptive`).

Why a probe. Off, every row falls behind, so a probe of every row fed all of it at once: at 64 streams at the
``1b`` shape under a bound of 1.25 such probes were the longest steps of the run (3.0 s against a median of
0.8 s, the drafting alone 0.8-1.4 s; ``docs/lab-notes/2026-11-29-probes.md``).

Why every step under a bound. The bound is on a step's predicted time, and the catch-up is not in it: at 64
streams at the ``1b`` shape a decision that switched 60 rows on at once fed their EAGLE layers every buffered
feature, 0.96 s of drafting in a step of 1.31 s, where plain decoding's longest steps took 0.42-0.58 s and a
stream's 99th-percentile gap is about the fifth longest step of a run of 500 requests. Cut, the longest drafting
steps of such runs were probes of 0.38-0.48 s (``docs/lab-notes/2026-11-30-catch-up-cap.md``). Without a bound
auto k maximises throughput alone, and a row switched on catches up at once.
"""

from __future__ import annotations

from specdec.step_cost import CostModel, tokens_fed

CATCH_UP_BUDGET = 4  # positions the joining rows catch up on, per row of the step (the least behind joins always)
RATE_EVIDENCE = 1.5  # decayed steps with rows joining (two) before the rate per position is gone by


def least_behind(ks: list[int], backlog: list[int], drafting: list[bool] | None = None,
                 price: list[float] | None = None, budget: float | None = None) -> list[int]:
    """``ks`` (per row, ``[B]``) kept for the rows drafting (``drafting[b]``: row ``b`` drafted on its previous
    step; none where not given) and for the joining rows with the least ``backlog`` (``[B]``, positions), the first
    always and then as long as their ``price`` (``[B]``; the backlog where not given) adds up to at most
    ``budget`` (``CATCH_UP_BUDGET`` per row of the step where not given); 0 for the others (see the module
    docstring). A row with ``ks[b] == 0`` is no candidate."""
    drafting = drafting or [False] * len(ks)
    price = backlog if price is None else price
    budget = CATCH_UP_BUDGET * len(ks) if budget is None else budget
    kept = {b for b, k in enumerate(ks) if k > 0 and drafting[b]}
    total, joined = 0.0, False
    for b in sorted((b for b, k in enumerate(ks) if k > 0 and not drafting[b]), key=lambda b: (backlog[b], b)):
        if joined and total + price[b] > budget:
            break
        kept.add(b)
        total, joined = total + price[b], True
    return [k if b in kept else 0 for b, k in enumerate(ks)]


def seconds_budget(ks: list[int], backlog: list[int], drafting: list[bool], cost: CostModel, max_step_ratio: float,
                   per_position: float, padded: bool = False, prompt_tokens: int = 0) -> tuple[list[float], float]:
    """The price of each row joining (``[B]``, seconds: its ``backlog`` at ``per_position`` seconds, and the tokens
    its ``ks`` add to the target's forward, none on a ``padded`` grid) and the budget: what ``max_step_ratio`` plain
    steps of ``cost`` (of the rows alone) leave of the step with the rows ``drafting`` alone and the
    ``prompt_tokens`` it feeds besides (see the module docstring)."""
    width = max(ks)
    staying = [k if d else 0 for k, d in zip(ks, drafting)]
    fed = tokens_fed(staying, width, padded) + prompt_tokens
    budget = cost.left_in_bound(max_step_ratio, len(ks), fed, width)
    verify = 0.0 if padded else cost.slope * cost.drafting_scale
    return [per_position * n + verify * k for n, k in zip(backlog, ks)], budget


class CatchUpRate:
    """The drafter's seconds per position caught up on, measured on the drafting steps that rows joined: the
    joining rows' backlog against the step's drafting seconds beyond the drafting line's prediction (a draft model's
    catch-up, timed apart, is in its drafting seconds; an EAGLE layer's is in its proposal's forward), as decayed
    sums (``decay`` per step added)."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.weight = self.positions = self.seconds = 0.0

    def add(self, positions: int, seconds: float) -> None:
        """A step whose joining rows caught up on ``positions`` positions in ``seconds`` (beyond the drafting's)."""
        self.weight = self.weight * self.decay + 1.0
        self.positions = self.positions * self.decay + positions
        self.seconds = self.seconds * self.decay + max(seconds, 0.0)

    def per_position(self) -> float | None:
        """Seconds per position caught up on, or None while fewer than two such steps were measured."""
        return self.seconds / self.positions if self.weight >= RATE_EVIDENCE and self.positions > 0 else None
