"""Auto k with the queue's weight against auto k as it was before, interleaved round by round
(:mod:`specdec.bench.interleaved`). With it, a step's prompt tokens are priced with its drafts, no step drafts
while prompt tokens wait past it (:mod:`specdec.k_choice`), and a step that feeds them in its own forward is a point
of the cost line (:mod:`specdec.adaptive`); without it, the policy is told no prompt tokens, none waiting, and
learns nothing of such a step's forward (its drafting is still timed). A benchmark, not a test:
``docs/lab-notes/2026-11-30-queue-weight.md`` used it.

    python scripts/queue_weight_ab.py --shape 1b --shape-cache /tmp/inflate_1b --methods plain,eagle,draft_model \\
        --concurrency 16 64 --num-requests 128 --max-tokens 32 --max-step-time-ratio 1.25 --rounds 2

``--control`` runs this checkout under both names instead (an A/A control: how far the host's noise alone moves
the ratios). Flags other than this script's own go to ``bench-serve``.
"""

from __future__ import annotations

import dataclasses

from specdec.adaptive import AdaptiveK
from specdec.bench import interleaved

CHOOSE, OBSERVE = AdaptiveK.choose, AdaptiveK.observe


def unweighed_choose(self, seqs, limits, backlog=None, prompt_tokens=0, prompt_backlog=0):
    """:meth:`AdaptiveK.choose` told that the step feeds no prompt tokens and that none wait."""
    return CHOOSE(self, seqs, limits, backlog, 0, 0)


def unweighed_observe(self, seqs, num_drafted, num_accepted, step):
    """:meth:`AdaptiveK.observe` of a step whose prompt chunks are taken as fed apart: no point of the line."""
    return OBSERVE(self, seqs, num_drafted, num_accepted, dataclasses.replace(step, prompt_fused=False))


def install(weighed: bool) -> None:
    """Patch :class:`AdaptiveK` for the runs that follow."""
    AdaptiveK.choose = CHOOSE if weighed else unweighed_choose
    AdaptiveK.observe = OBSERVE if weighed else unweighed_observe


def main() -> None:
    parser = interleaved.arguments(__doc__.split("\n\n")[0], rounds=2)
    cli, rest = parser.parse_known_args()
    interleaved.main(cli, rest, {"weighed": lambda: install(True), "unweighed": lambda: install(False)})


if __name__ == "__main__":
    main()
