"""Which rows draft on a step where their drafters have something to catch up: :func:`least_behind`, used by
auto k (:class:`specdec.adaptive.AdaptiveK`) on a probe while speculation is off and, under a bound on a drafting
step's time, on every drafting step.

Terms. A row's ``backlog`` (:meth:`specdec.drafters.base.Drafter.backlog`) is the positions its drafter feeds its
own model before its first draft: a draft model's slot falls behind by every token emitted while the row does not
draft (and is fed the prompt at the row's first draft), an EAGLE layer buffers every target feature, the prompt's
included. A row *drafting* drafted on its previous step: its backlog is what that step committed (the pending
token and the accepted drafts), the steady feed that a drafting step's measured time includes. The others
*join*: their catch-up is a cost of switching, paid once, that auto k leaves out of a step's price
(:mod:`specdec.adaptive`).

The rule. The rows drafting keep their drafts. Of the rows joining, the least behind joins always (ties: the
earlier row), and the next least behind as long as the joining rows' backlogs add up to at most
``CATCH_UP_BUDGET`` positions per row of the step. The others draft nothing this step and join on a later one.

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

CATCH_UP_BUDGET = 4  # positions the joining rows catch up on, per row of the step (the least behind joins always)


def least_behind(ks: list[int], backlog: list[int], drafting: list[bool] | None = None) -> list[int]:
    """``ks`` (per row, ``[B]``) kept for the rows drafting (``drafting[b]``: row ``b`` drafted on its previous
    step; none where not given) and for the joining rows with the least ``backlog`` (``[B]``, positions), the first
    always and then as long as their backlogs add up to at most ``CATCH_UP_BUDGET`` per row of the step; 0 for the
    others (see the module docstring). A row with ``ks[b] == 0`` is no candidate."""
    drafting = drafting or [False] * len(ks)
    kept = {b for b, k in enumerate(ks) if k > 0 and drafting[b]}
    total, budget, joined = 0, CATCH_UP_BUDGET * len(ks), False
    for b in sorted((b for b, k in enumerate(ks) if k > 0 and not drafting[b]), key=lambda b: (backlog[b], b)):
        if joined and total + backlog[b] > budget:
            break
        kept.add(b)
        total, joined = total + backlog[b], True
    return [k if b in kept else 0 for b, k in enumerate(ks)]
