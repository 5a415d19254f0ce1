"""How many tokens each row drafts per step: a fixed k, or ``"auto"`` from measured acceptance and cost.

The auto model. A row whose draft position ``i`` is accepted with conditional rate ``a_i`` (``d_i``
kept given ``d_1..d_{i-1}`` were) emits, drafting ``k`` tokens, ``E(k) = 1 + sum_{j<=k} prod_{i<=j}
a_i`` tokens in expectation; with a constant ``a_i = α`` that is ``(1 − α^(k+1)) / (1 − α)``. A step
over ``B`` rows drafting ``k_b`` tokens each, the longest ``w``, costs ``T = t(B + sum k_b) + D(w)``:
``t(N)``, the target forward with verification and bookkeeping over ``N`` tokens, is a straight
line fitted to recent steps (so verification that stops being free at a larger batch shows as
its slope; on a backend that pads rows to the longest, ``N = B (w + 1)``, the cells its grid
computes whatever each row drafted), and ``D(w) = d_0 + w·d`` (0 for ``w = 0``) the drafting time, a
second line fitted to the drafting steps: ``d`` per sequential draft position and ``d_0`` per drafting
step whatever its width (a draft model's forward over the tokens accepted last step, per-step set-up);
until widths differ enough to fit a slope, ``d_0 = 0`` and ``d`` is the mean time per position.
The policy picks the ``k_b`` maximising predicted tokens per second ``(B + sum (E_b(k_b) − 1)) / T``,
plain decoding (every ``k_b = 0``) included: speculation is off for a step whose predicted speedup
is below 1 (:mod:`specdec.k_choice`). At ``B = 1`` with a flat ``t`` and ``d_0 = 0`` this is the argmax
of ``S(k) = E(k) / (k c + 1)`` with ``c = d / t(1)``. A step that also feeds ``P`` prompt tokens (chunked
prefill) is priced as ``(B + P + sum (E_b(k_b) − 1)) / (t(B + P + sum k_b) + D(w))``: the prompt tokens are work
the step does whatever it drafts, which drafts must not slow for less than they add (the queue's weight,
:mod:`specdec.k_choice`). Such a step, when its forward feeds the chunks too (``StepCost.prompt_fused``: the
fast backend on a CPU), adds that forward's seconds over all its tokens to ``t``'s line, and its drafting to
``D``'s, but nothing to the shapes or the calibration below. A server at saturation feeds prompts on most steps:
without them the line kept the few steps that fed none, at 64 streams of the ``1b`` shape on a 2-core CPU mostly
the warm-up's one- and two-row steps, whose slope of about 0 priced every draft as free (and the prompt tokens'
weight at nothing).

A drafter asked for a draft need not propose one: an n-gram lookup finds no match on about 40% of
the embedded pair's steps at one row (code and Spec-Bench). A row that proposes nothing emits its one
token and feeds the target only that token, except on a padded grid, where it costs the step's
width like every row. So each row also has ``p_b``, the measured probability that its drafter
proposes when asked (decayed counts per sequence, with the pool's rate as prior, like acceptance):
its drafts are worth ``p_b (E_b(k_b) − 1)`` tokens and feed ``p_b k_b`` tokens in expectation
(:func:`choose_ks`; one row is a drafting step with probability ``p_b``, a plain one otherwise).
Without it a padded batch of 16 rows, many of them without a match, was charged for the grid yet
credited with tokens those rows never emitted, and drafted too wide.

A target's cost is a line only roughly: kernels work in tiles, and a GPU replays a CUDA graph
captured for a bucket of shapes, so ``t`` climbs in steps (on the embedded pair's CPU, 17 tokens
cost 15% more than 16). So each timed step also records its time under its shape (rows, tokens), as
a decayed mean per shape (``shape_decay`` per step of that shape, so that the shapes chosen follow
the machine getting slower or faster; slower by up to 2.5% a step, as a step counts as at most ``HICCUP`` times
the mean, as in the calibration below: off, a drafting shape is timed only at probes, and four two-token steps of
a slow phase of the host, counted in full, priced one draft over the bound at one stream at ``1b`` for 58 steps;
``docs/lab-notes/2026-11-30-bound-edge.md``). A shape measured in two timed steps or more, the last within
``SHAPE_MEMORY`` steps (a shape not renewed goes stale as the machine drifts, and is forgotten),
is predicted by that mean where it is ``SHAPE_TOLERANCE`` (10%) or more off the line, and by the
line where it is closer (noise the choice would chase); a shape not measured, by the line moved by
the offset of the largest measured shape below it at that row count (:class:`CostModel`). A shape
is measured once it was chosen, and one forgotten is chosen again where the line says it pays; to
find a cheaper neighbour the line cannot see, every ``probe_every`` steps (offset by half a period
from the probes below) every row drafting the step's width drafts one position fewer, and once
that narrower shape is measured, only every ``FAR_PROBES * probe_every`` steps.

Estimates are online: acceptance per sequence (decayed counts, with the engine-wide pool of all
sequences, as it stands at each step, as their prior: a position a sequence stopped trying goes
back to the pool's rate, not to a rate of long ago), cost per engine. In the pool, a position with
few tries leans on the rate of the position before it (its prior), not on a constant: conditional
acceptance changes slowly along a draft, and a constant prior below the measured rates would keep
longer drafts from ever being tried. Every ``probe_every`` steps the decision is
inverted once (a plain step when speculating, short drafts when not) so that both ends of the
cost line stay measured (a plain step timed within the period anyway, every row's drafter having
proposed nothing, takes the plain probe's place); where the calibrated prediction below is more than ``FAR_ABOVE`` times
plain decoding (far from switching speculation off), the plain probes back off, as each one gives up
the tokens of a speculative step: the period doubles after each probe taken there (``FAR_PROBES``
periods at most), and falls back to ``probe_every`` at the first step that is not far. The
speculative probes back off the same way (up to ``FAR_BELOW_PROBES`` periods) where speculation is
off and the model (uncalibrated) predicts the probe itself below ``1 / FAR_ABOVE`` times plain
decoding: at 16 rows on a 2-core CPU a probe of 2 tokens a row costs about three plain steps, and
probing every 16 steps cost such a batch 8–9% (methods that never paid ran 0.91–0.92x plain at the
``1b`` shape). The model alone decides it, as the probe's shape is measured after two probes: where
only the calibration keeps speculation off (the model would speculate), the probes stay every
``probe_every`` steps, as they are what moves the calibration back when speculating pays again. The first
step of each shape (rows, tokens, width) is not timed (it pays one-time set-up: kernel selection, CUDA graph
capture), nor is any step that paid one (``StepCost.setup``: a graph captured or compiled for a cache-length
bucket or a shape specialisation first reached later, which on a GPU can cost seconds: counted as a step's
cost, it could turn speculation off for a whole run), a step slower than ``OUTLIER`` times the prediction
counts as that, and drafting right after a step without drafts (the drafter catching up) is left out of the
drafting line, as is any step's ``catch_up_seconds`` (below).

The guard: calibration by measured step times. The cost model is a prediction: kernels whose cost
is not linear in the tokens fed and per-step overheads it does not charge can make it speculate where
speculating is slower. So the policy also compares, per number of rows in the step, every step's measured
seconds (``target_seconds + draft_seconds`` less ``catch_up_seconds``) with what the model predicted for it,
as decayed sums ``Σ measured / Σ predicted``
(``guard_decay`` per step of that kind; the first step of each shape left out as above, a step
counted as at most ``HICCUP`` times what the calibration expected of it), for drafting and for plain steps
apart, each step's measured seconds divided by the host's pace when it ran (:class:`specdec.step_cost.Pace`: the
last few steps' measured over expected seconds, whatever their kind), so that a probe is compared with the steps
just before it, not with steps of its kind measured long ago in another phase of the host. Once both kinds are
measured at that row count (decayed weight at least ``GUARD_EVIDENCE``, about three steps each), the drafting
steps' ratio over the plain steps' ratio scales every drafting step's predicted cost; the choice above,
speculation off included, is then made with the scaled costs. So the measurement, not the model alone, decides
whether speculating pays at a batch size, while acceptance stays each sequence's own (a measured throughput
compared directly would mix the acceptance of whichever requests ran last into every request's decision). The key
is the exact row count: cost errors depend on the batch's shape, and a row count seen too briefly to be measured
both ways is left to the model. A drafter's catch-up (:meth:`specdec.drafters.base.Drafter.catch_up`: a draft
model feeding the tokens of the steps it sat out, or the prompt it starts on lazily) is a cost of switching,
paid once, not what drafting costs: counted, every probe while speculation was off paid the whole pause's
catch-up (a draft model's forward over 16 tokens and more, 0.1-0.2 s against 0.05 s for a draft at the
``1b`` shape on a 2-core CPU), which priced one draft over a bound of 1.25 at one stream, so speculation
stayed off however well its probes were accepted. A drafter whose catch-up is part of its proposal's one
forward (an EAGLE layer feeding its buffered features) has it counted still.

The policy's own work is part of every step (tens of microseconds of Python, against steps of a few
milliseconds), so where there is nothing to decide it does less: with drafts that cost next to
nothing (drafting the most costs under ``HOLD_DRAFT_SHARE`` of a plain step: an n-gram or suffix
lookup, not a draft model, whose every position is a trade-off made again each step), a decision
that gives every row the most any row drafts (``max_k``), far ahead (above ``FAR_ABOVE``), whose step
shape is measured (not a shape being explored), is held for the next steps at that row count, one step,
then three, up to ``HOLD_MAX - 1``, each row clipped to its own limit (probes come as scheduled). A row
allowed fewer (near the end of its budget) starts no hold: the request after it at that row count would
inherit a decision made for another's limit, past a bound on the step's time. Any other decision
ends the hold (a decision below the most may be made on a small margin, and is made again each
step). The cost model is refitted every ``COST_REFRESH`` timed steps, not every step.

The bound (``max_step_ratio``: ``speculative_config["max_step_time_ratio"]``). A step that rejects every
draft gives each row one token for the whole step, drafting and verification included, so a stream's
worst inter-token gaps are the drafting steps' times, not plain decoding's. With a bound, the policy
chooses only among drafts whose step, every row proposing, is predicted (calibrated as above) to cost at
most ``max_step_ratio`` plain steps of the same rows, plain decoding included
(:func:`specdec.k_choice.choose_ks`); a probe while speculation is off drafts one position, not
``PROBE_DRAFT``, and so does a cold start (the first drafting step, or one after the cost line lost its
spread: steps of one shape for long), not every row's most; and no row drafts more than one position past
the widest step timed at that row count, so the cost line is not trusted far past what was measured (it
had eagle draft 8 where a step of 8 cost well over the bound at ``1b``). A probe the model (uncalibrated) predicts
over the bound backs off as a probe priced far below plain decoding does: it is a step over the bound, and it pays
every row's drafter catching up on the steps without drafts. A probe is not taken at all where even its cheapest
form, one row drafting one position, is predicted so (uncalibrated), as on a padded grid at a row count where the
target's forward is bound by arithmetic: one draft doubles the grid (at 64 streams at ``1b`` on a 2-core CPU, probes
of one to three rows took 1.3-1.8 plain steps and were among a run's longest;
``docs/lab-notes/2026-11-30-probes-within-the-bound.md``). Such a probe could measure nothing that turns speculation
on there: every drafting step is priced over the bound by the model itself. The row's catch-up is left out of that
check, as out of the calibration: priced in, a row off long enough was too far behind for any probe to fit, and the
longer speculation stayed off the further behind it fell (at one stream at ``1b``, a refusal priced 113 positions at
0.069 s where the step left 0.003 s; ``docs/lab-notes/2026-11-30-probe-catch-up.md``). The most tokens per second
within a bound on the worst gap.

A probe while speculation is off drafts only the rows least behind, as does every drafting step under a bound (in
what the bound leaves of the step, once the catch-up's seconds a position are measured): :mod:`specdec.catch_up`.

Such a probe also waits for a step that feeds no prompt tokens (chunked prefill: the prefill pacer leaves one
every few steps, and a server with no prompt to feed feeds none). On a step feeding a prompt chunk, the probe's
drafting and catch-up came on top of the chunk's share of the step: at 16 streams at the ``1b`` shape such probes
took 2.0-2.4x the median plain step, their drafting 0.05-0.06 s of it, and they were the run's longest steps
(``docs/lab-notes/2026-11-30-queue-and-probes.md``).

Any rule that fixes ``k`` before a step is drafted keeps verification lossless; with ``"auto"``
the rule depends on timings, so a seeded sampled request is distributed exactly as the target but
need not repeat the same tokens run to run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from specdec.acceptance import Acceptance, ProposalRate
from specdec.catch_up import CatchUpRate, least_behind, seconds_budget
from specdec.k_choice import choose_ks, predicted_speedup
from specdec.k_schedule import FixedK, ScheduledK
from specdec.metrics import BatchMetrics
from specdec.sequence import Sequence
from specdec.step_cost import HICCUP, OUTLIER, Calibration, CostModel, LineFit, Pace, StepCost, tokens_fed

AUTO = "auto"
DEFAULT_MAX_SPECULATIVE_TOKENS = 8
PRIOR_ACCEPTANCE = 0.7  # the first sequence's prior per position, before anything was measured
PROBE_DRAFT = 2  # tokens per row on a probe step while speculation is off
FAR_ABOVE = 1.25  # calibrated predicted speedup above which speculation is far from being switched off
FAR_PROBES = 32  # there, the probe period doubles per probe up to FAR_PROBES * probe_every steps
FAR_BELOW_PROBES = 8  # off, a probe priced below 1 / FAR_ABOVE or over the bound: period doubles up to this
GUARD_EVIDENCE = 2.5  # decayed steps of each kind the calibration needs at a row count before it applies
SHAPE_EVIDENCE = 1.5  # decayed timed steps of one shape (two) before its measured mean replaces the line there
SHAPE_TOLERANCE = 0.1  # a shape's measured mean this far off the line or farther replaces it (closer is noise)
SHAPE_MEMORY = 1024  # steps after which a shape's measurement not renewed is forgotten
HOLD_MAX = 8  # steps a decision of every row at its most, far ahead, is held at most
HOLD_DRAFT_SHARE = 0.1  # ... where drafting the most costs less than this share of a plain step
COST_REFRESH = 4  # measured steps between refits of the cost model


class AdaptiveK:
    """``num_speculative_tokens="auto"``: per row and step, the k the measured model predicts to be
    fastest, at most ``max_k`` (see the module docstring)."""

    def __init__(self, max_k: int, probe_every: int = 16, seq_decay: float = 0.9, pool_decay: float = 0.99,
                 cost_decay: float = 0.95, draft_decay: float = 0.9, guard_decay: float = 0.9,
                 shape_decay: float = 0.9, pace_decay: float = 0.8, padded: bool = False,
                 max_step_ratio: float | None = None) -> None:
        self.max_k, self.probe_every, self.seq_decay, self.padded = max_k, probe_every, seq_decay, padded
        self.max_step_ratio = max_step_ratio  # the most a drafting step may cost, in plain steps (None: any)
        self.pool = Acceptance(max_k, pool_decay, prior_weight=1.0, carry=True)
        self.prior = [PRIOR_ACCEPTANCE] * max_k  # the pool's, before anything was measured
        self.target = LineFit(cost_decay)
        self.drafting = LineFit(draft_decay)  # drafting seconds against width, over drafting steps
        self.seqs: dict[str, Acceptance] = {}
        self.pool_proposals = ProposalRate(pool_decay, prior_weight=1.0)  # prior 1: a drafter proposes
        self.proposals: dict[str, ProposalRate] = {}  # per sequence, the pool's rate as prior
        self.asked: list[int] = []  # the ks of the step chosen last, row by row
        self.drafted: set[str] = set()  # the requests that drafted on the step observed last
        self.joining = 0  # positions the rows joining the drafting caught up on, on the step chosen last
        self.catch_up = CatchUpRate(draft_decay)  # the drafter's seconds per position caught up on
        self.seen: set[tuple[int, int, int]] = set()  # (rows, tokens, width) of steps timed so far
        self.widest: dict[int, int] = {}  # rows -> the widest draft of a step timed at that row count
        self.shape_decay = shape_decay
        # rows -> tokens -> (decayed timed steps, decayed seconds, the step it was last timed)
        self.shapes: dict[int, dict[int, tuple[float, float, int]]] = {}
        self.steps = 0
        self.next_probe = probe_every  # the step that inverts the decision
        self.next_narrow = probe_every + probe_every // 2  # the step that drafts one position fewer
        self.probe_period = probe_every  # steps to the probe after it
        self.last_width = 0
        self.last_speedup = 1.0
        self.guard_decay = guard_decay
        self.calibration: dict[int, tuple[Calibration, Calibration]] = {}  # rows -> (plain, drafting) steps
        self.pace = Pace(pace_decay)  # the host's speed now, which each step's calibration is taken at
        self.last_plain: dict[int, int] = {}  # rows -> the step a plain step of that many rows was last timed
        self.hold_period = 1  # steps the next decision of every row at its most holds for
        self.held = 0  # steps left holding every row at its most
        self.held_rows = 0  # the row count of the held decision
        self.measured = 0  # steps timed
        self.metrics: BatchMetrics | None = None
        self._costs: dict[int, CostModel | None] = {}  # cost_model(rows), refitted every COST_REFRESH timed steps

    def bind_metrics(self, metrics: BatchMetrics) -> None:
        """The engine's aggregate metrics, where the choices are counted (``k_choices``,
        ``num_speculation_off_steps``) beside each request's own ``k_choices``."""
        self.metrics = metrics

    def _acceptance(self, seq: Sequence) -> Acceptance:
        estimate = self.seqs.get(seq.request_id)
        if estimate is None:
            estimate = Acceptance(self.max_k, self.seq_decay, prior_weight=2.0)
            self.seqs[seq.request_id] = estimate
        return estimate

    def _proposing(self, seq: Sequence) -> ProposalRate:
        estimate = self.proposals.get(seq.request_id)
        if estimate is None:
            estimate = self.proposals[seq.request_id] = ProposalRate(self.seq_decay, prior_weight=2.0)
        return estimate

    def draft_cost(self) -> tuple[float, float] | None:
        """``(d_0, d)``: drafting seconds per drafting step and per draft position (see the module docstring),
        or None before a drafting step was measured."""
        weight, widths, _, seconds, _ = self.drafting.sums
        if weight == 0:
            return None
        if self.drafting.spread:
            fixed, per_position = self.drafting.line()
            if per_position > 0:
                return max(fixed, 0.0), per_position
        return 0.0, seconds / widths

    def cost_model(self, rows: int) -> CostModel | None:
        """The fitted cost of a step over ``rows`` rows, with the offsets of the shapes measured at that
        row count, or None until a plain and a drafting step were both measured."""
        draft = self.draft_cost()
        if not self.target.spread or draft is None:
            return None
        a, b = self.target.line()
        offsets, shapes = [], self.shapes.get(rows, {})
        for n in sorted(shapes):
            weight, seconds, step = shapes[n]
            if self.steps - step > SHAPE_MEMORY:
                del shapes[n]
            elif weight >= SHAPE_EVIDENCE:  # measured (see _measured); within the tolerance, the line holds
                off = seconds / weight - a - b * n
                offsets.append((n, off if abs(off) >= SHAPE_TOLERANCE * (a + b * n) else 0.0))
        return CostModel(a, b, draft[1], draft[0], offsets=tuple(offsets))

    def _model(self, rows: int) -> CostModel | None:
        """:meth:`cost_model`, refitted every ``COST_REFRESH`` timed steps (the fit moves slowly)."""
        if rows not in self._costs:
            self._costs[rows] = self.cost_model(rows)
        return self._costs[rows]

    def _measured(self, rows: int, num_tokens: int) -> bool:
        """Whether steps of this shape were timed often enough, and recently enough (within
        ``SHAPE_MEMORY`` steps), to be predicted by their own mean."""
        weight, _, step = self.shapes.get(rows, {}).get(num_tokens, (0.0, 0.0, 0))
        return weight >= SHAPE_EVIDENCE and self.steps - step <= SHAPE_MEMORY

    def _fed(self, ks: list[int]) -> int:
        """Tokens a step drafting ``ks`` feeds the target."""
        return tokens_fed(ks, max(ks), self.padded)

    def choose(self, seqs: list[Sequence], limits: list[int],
               backlog: Callable[[list[Sequence]], list[int]] | None = None, prompt_tokens: int = 0,
               prompt_backlog: int = 0) -> list[int]:
        """Tokens to draft per row; ``limits[b]`` is the most row ``b`` may draft this step. ``backlog(seqs)[b]``
        is the positions row ``b``'s drafter would catch up on before drafting (None: nothing), which bounds a
        step's rows (:meth:`_caps`); it is asked only on a step that drafts. ``prompt_tokens``:
        the prompt tokens the step feeds besides (chunked prefill), priced with the drafts
        (:func:`~specdec.k_choice.choose_ks`), and a probe while speculation is off waits for a step that feeds
        none; ``prompt_backlog``: prompt tokens that wait past the next step (a queue), while there are any, no
        row drafts (the queue's weight, :mod:`specdec.k_choice`)."""
        limits = [min(self.max_k, limit) for limit in limits]
        self.steps += 1
        self.joining = 0
        if not any(limits):  # no row may draft (every one is at its last token): nothing to choose or probe
            self.asked = [0] * len(limits)
            return self.asked
        if prompt_backlog:  # a queue of prompts: drafts would slow its feeding (nothing to probe either)
            self.held = 0
            return self._count(seqs, limits, [0] * len(limits))
        if self.held and len(seqs) == self.held_rows and self.steps < min(self.next_probe, self.next_narrow):
            self.held -= 1
            return self._count(seqs, limits, limits)
        cost = self._model(len(seqs))
        probe = [min(PROBE_DRAFT if self.max_step_ratio is None else 1, limit) for limit in limits]
        if cost is None:  # cold start, or a line gone flat (then as a probe): a drafting step, then a plain one
            if self.draft_cost() is not None:
                if self.steps < self.next_probe or not self._may_probe([], prompt_tokens):
                    return self._count(seqs, limits, [0] * len(limits))
                self.next_probe = self.steps + self.probe_period
            first = limits if self.max_step_ratio is None else probe
            return self._count(seqs, limits, self._catching_up(first, seqs, backlog) if self._caps(False) else first)
        pool = self.pool.rates(self.prior)
        rates = [self._acceptance(s).rates(pool) for s in seqs]
        model, scale = cost, self.drafting_scale(len(seqs))
        if scale is not None:
            cost = replace(cost, drafting_scale=scale)
        pooled = self.pool_proposals.rate(1.0)
        proposing = [self._proposing(s).rate(pooled) for s in seqs]
        reach = limits
        if self.max_step_ratio is not None:  # one position past the widest step timed at this row count
            reach = [min(limit, self.widest.get(len(seqs), 0) + 1) for limit in limits]
        ks, self.last_speedup = choose_ks(rates, reach, cost, self.padded, proposing, self.max_step_ratio,
                                          prompt_tokens)
        probing = False  # a probe of drafting while speculation is off
        far = scale is not None and self.last_speedup > FAR_ABOVE  # far from switching speculation off
        below = not any(ks) and (predicted_speedup(rates, probe, model, self.padded, proposing) < 1 / FAR_ABOVE
                                 or self._over_bound(probe, model))
        free = cost.draft_fixed + cost.draft * max(ks) < HOLD_DRAFT_SHARE * cost.target_seconds(len(ks))
        holds = far and free and ks == limits and min(limits) == self.max_k
        if holds and self._measured(len(ks), self._fed(ks)):  # held, longer each time
            self.hold_period = min(2 * self.hold_period, HOLD_MAX)
            self.held, self.held_rows = self.hold_period - 1, len(ks)
        else:
            self.hold_period, self.held = 1, 0
        if not (far or below):  # near the switch (or uncalibrated): probe every probe_every steps again
            self.probe_period = self.probe_every
            self.next_probe = min(self.next_probe, self.steps + self.probe_every)
        if self.steps >= self.next_probe and self._may_probe(ks, prompt_tokens):  # invert the decision once
            if not any(ks):
                if self._cheapest_fits(len(seqs), model):
                    ks, probing = probe, True
                if below:
                    self.probe_period = min(2 * self.probe_period, FAR_BELOW_PROBES * self.probe_every)
            elif self.steps - self.last_plain.get(len(ks), -self.probe_period) >= self.probe_period:
                ks = [0] * len(ks)
                if far:
                    self.probe_period = min(2 * self.probe_period, FAR_PROBES * self.probe_every)
            self.next_probe = self.steps + self.probe_period
        elif self.steps >= self.next_narrow and max(ks) > 1:  # measure the shape one position narrower
            narrower = [min(k, max(ks) - 1) for k in ks]
            known = self._measured(len(ks), self._fed(narrower))
            self.next_narrow = self.steps + self.probe_every * (FAR_PROBES if known else 1)
            ks = narrower
        cut = self._catching_up(ks, seqs, backlog, cost, prompt_tokens) if self._caps(probing) else ks
        return self._count(seqs, limits, cut)

    def _caps(self, probing: bool) -> bool:
        """Whether a step's drafting rows are cut to those whose drafters catch up within the budget
        (:meth:`_catching_up`): a probe while speculation is off, and under a bound every step."""
        return probing or self.max_step_ratio is not None

    def _catching_up(self, ks: list[int], seqs: list[Sequence], backlog: Callable[[list[Sequence]], list[int]] | None,
                     cost: CostModel | None = None, prompt_tokens: int = 0) -> list[int]:
        """``ks`` cut by :func:`~specdec.catch_up.least_behind` (the rows that drafted on the step observed last, and
        those joining within the budget: in seconds under a bound, ``prompt_tokens`` counted, once ``cost`` and the
        catch-up's rate are known, :func:`~specdec.catch_up.seconds_budget`), or ``ks`` where there is no backlog or
        nothing is drafted."""
        if backlog is None or not any(ks):
            return ks
        behind, drafting = backlog(seqs), [s.request_id in self.drafted for s in seqs]
        price, budget, rate = None, None, self.catch_up.per_position()
        if self.max_step_ratio is not None and cost is not None and rate is not None:
            price, budget = seconds_budget(ks, behind, drafting, cost, self.max_step_ratio, rate, self.padded,
                                           prompt_tokens)
        cut = least_behind(ks, behind, drafting, price, budget)
        self.joining = sum(n for n, k, d in zip(behind, cut, drafting) if k and not d)
        return cut

    def _may_probe(self, ks: list[int], prompt_tokens: int) -> bool:
        """Whether a step deciding ``ks`` and feeding ``prompt_tokens`` may be a probe that is due: a probe of
        drafting (speculation off) waits for a step that feeds no prompt (see the module docstring)."""
        return any(ks) or not prompt_tokens

    def _cheapest_fits(self, rows: int, model: CostModel) -> bool:
        """Whether a probe's cheapest form over ``rows`` rows, one row drafting one position, is predicted by
        ``model`` (uncalibrated) within the bound (True without a bound); the row's catch-up is not priced: a cost
        of switching, paid once (see the module docstring)."""
        return not self._over_bound([1] + [0] * (rows - 1), model)

    def _over_bound(self, ks: list[int], model: CostModel) -> bool:
        """Whether a step drafting ``ks`` is predicted by ``model`` (uncalibrated) over the bound on a drafting
        step's time, every row proposing (False without a bound)."""
        if self.max_step_ratio is None:
            return False
        return model.left_in_bound(self.max_step_ratio, len(ks), self._fed(ks), max(ks)) < 0.0

    def drafting_scale(self, rows: int) -> float | None:
        """How much more (or less) drafting steps over ``rows`` rows measured than the model predicted,
        relative to plain steps: the calibration of the module docstring, or None while either kind was
        measured too little to go by."""
        plain, drafting = self.calibration.get(rows, (None, None))
        if plain is None or min(plain.weight, drafting.weight) < GUARD_EVIDENCE:
            return None
        return drafting.ratio() / plain.ratio()

    def _count(self, seqs: list[Sequence], limits: list[int], ks: list[int]) -> list[int]:
        """Count the step's choices (rows that could draft only) in each request's and the engine's metrics."""
        for s, limit, k in zip(seqs, limits, ks):
            if limit > 0:
                s.metrics.k_choices[k] = s.metrics.k_choices.get(k, 0) + 1
        if self.metrics is not None:
            self.metrics.count_k_choices(ks, limits)
        self.asked = ks
        return ks

    def observe(self, seqs: list[Sequence], num_drafted: list[int], num_accepted: list[int], step: StepCost) -> None:
        """Learn a step's outcome: acceptance of each row and of the pool, and the step's cost."""
        asked = self.asked if len(self.asked) == len(seqs) else num_drafted  # what choose gave these rows
        self.drafted = {s.request_id for s, n in zip(seqs, num_drafted) if n}
        for s, k, n, a in zip(seqs, asked, num_drafted, num_accepted):
            if k:  # asked to draft: whether it proposed anything
                self._proposing(s).update(n > 0)
                self.pool_proposals.update(n > 0)
            if n:
                self._acceptance(s).update(n, a)
                self.pool.update(n, a)
        last_width, self.last_width = self.last_width, step.width
        if step.setup:  # a one-time set-up: not what the step costs
            return
        if self.joining and step.width and (draft := self.draft_cost()):  # rows joined: what their catch-up cost
            self.catch_up.add(self.joining, step.draft_seconds - draft[0] - draft[1] * step.width)
        cost = self._model(len(seqs))
        if step.prompt_tokens:  # prompt chunks fed: not its shape's time, but its forward's over all its tokens
            if step.prompt_fused:
                self._add_target(cost, step.num_tokens + step.prompt_tokens, step.target_seconds)
            self._add_drafting(step, last_width)
            return
        shape = (len(seqs), step.num_tokens, step.width)
        if shape not in self.seen:  # the first step of a shape pays one-time set-up (kernels, graphs)
            self.seen.add(shape)
            return
        self.widest[len(seqs)] = max(self.widest.get(len(seqs), 0), step.width)
        if not step.width:
            self.last_plain[len(seqs)] = self.steps
        if cost is not None:
            predicted = cost.target_seconds(step.num_tokens)
            # The calibration: everything the step cost but the drafter's catch-up (a cost of switching).
            kinds = self.calibration.get(len(seqs))
            if kinds is None:
                kinds = self.calibration[len(seqs)] = (Calibration(self.guard_decay), Calibration(self.guard_decay))
            self.pace.calibrate(kinds[1] if step.width else kinds[0],
                                step.target_seconds + step.draft_seconds - step.catch_up_seconds,
                                cost.with_drafting(predicted, step.width))
        target = self._add_target(cost, step.num_tokens, step.target_seconds)
        shapes = self.shapes.setdefault(len(seqs), {})
        weight, seconds, _ = shapes.get(step.num_tokens, (0.0, 0.0, 0))
        if weight:  # a hiccup counts as at most HICCUP times the shape's mean, as in the calibration
            target = min(target, HICCUP * seconds / weight)
        shapes[step.num_tokens] = (weight * self.shape_decay + 1.0, seconds * self.shape_decay + target, self.steps)
        self._add_drafting(step, last_width)

    def _add_target(self, cost: CostModel | None, num_tokens: int, seconds: float) -> float:
        """Add a timed forward over ``num_tokens`` tokens to the target's line (a hiccup of the machine counts as
        at most ``OUTLIER`` times the prediction), refitting every ``COST_REFRESH`` of them; returns the seconds
        added."""
        self.measured += 1
        if cost is None or self.measured % COST_REFRESH == 0:
            self._costs.clear()
        if cost is not None:
            seconds = min(seconds, OUTLIER * cost.target_seconds(num_tokens))
        self.target.add(num_tokens, seconds)
        return seconds

    def _add_drafting(self, step: StepCost, last_width: int) -> None:
        """Add a drafting step's drafting seconds to the drafting line. After a step without drafts the drafter
        first catches up on the tokens it missed: not the cost of a drafting step in the steady state."""
        if step.width and last_width:
            draft = self.draft_cost()  # the line as measured so far, as the catch-up's rate takes it
            seconds = step.draft_seconds - step.catch_up_seconds  # a prompt caught up on (a row just started)
            if draft is not None:
                seconds = min(seconds, OUTLIER * (draft[0] + draft[1] * step.width))
            self.drafting.add(step.width, seconds)

    def release(self, seq: Sequence) -> None:
        self.seqs.pop(seq.request_id, None)
        self.proposals.pop(seq.request_id, None)


def make_policy(num_speculative_tokens: int | str, max_k: int, padded: bool = False,
                schedule: tuple[tuple[int, int], ...] | None = None,
                max_step_ratio: float | None = None) -> FixedK | AdaptiveK | ScheduledK:
    """The policy of a ``num_speculative_tokens`` setting: ``"auto"`` (at most ``max_k``; ``padded``:
    the target's forward pads every row to the longest; ``max_step_ratio``: the bound on a drafting step's
    predicted cost in plain steps; see :class:`AdaptiveK`) or a fixed k; a
    ``num_speculative_tokens_per_batch_size`` ``schedule`` (:mod:`specdec.k_schedule`) overrides both."""
    if schedule is not None:
        return ScheduledK(schedule)
    if num_speculative_tokens == AUTO:
        return AdaptiveK(max_k, padded=padded, max_step_ratio=max_step_ratio)
    return FixedK(max_k)
