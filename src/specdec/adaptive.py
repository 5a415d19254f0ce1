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
is below 1. At ``B = 1`` with a flat ``t`` and ``d_0 = 0`` this is the argmax of ``S(k) = E(k) / (k c + 1)`` with
``c = d / t(1)``.

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
the machine getting slower or faster). A shape measured in two timed steps or more, the last within
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
drafting line.

The guard: calibration by measured step times. The cost model is a prediction: kernels whose cost
is not linear in the tokens fed, the drafter catching up after steps without drafts, and per-step
overheads it does not charge can make it speculate where speculating is slower. So the policy also
compares, per number of rows in the step, every step's measured seconds (``target_seconds +
draft_seconds``, a drafting step right after a plain one with the drafter's catch-up: a real cost of
switching) with what the model predicted for it, as decayed sums ``Σ measured / Σ predicted``
(``guard_decay`` per step of that kind; the first step of each shape left out as above, a step
counted as at most ``OUTLIER`` times the mean of its kind so far), for drafting and for plain steps
apart. Once both kinds are measured at that row count (decayed weight at least ``GUARD_EVIDENCE``,
about three steps each), the drafting steps' ratio over the plain steps' ratio scales every drafting
step's predicted cost; the choice above, speculation off included, is then made with the scaled
costs. So the measurement, not the model alone, decides whether speculating pays at a batch size,
while acceptance stays each sequence's own (a measured throughput compared directly would mix the
acceptance of whichever requests ran last into every request's decision). The key is the exact row
count: cost errors depend on the batch's shape, and a row count seen too briefly to be measured both
ways is left to the model.

The policy's own work is part of every step (tens of microseconds of Python, against steps of a few
milliseconds), so where there is nothing to decide it does less: with drafts that cost next to
nothing (drafting the most costs under ``HOLD_DRAFT_SHARE`` of a plain step: an n-gram or suffix
lookup, not a draft model, whose every position is a trade-off made again each step), a decision
that gives every row its most, far ahead (above ``FAR_ABOVE``), whose step shape is measured (not a
shape being explored), is held for the next steps at that row count, one step, then three, up to
``HOLD_MAX - 1``, each row clipped to its own limit (probes come as scheduled); any other decision
ends the hold (a decision below the most may be made on a small margin, and is made again each
step). The cost model is refitted every ``COST_REFRESH`` timed steps, not every step.

Any rule that fixes ``k`` before a step is drafted keeps verification lossless; with ``"auto"``
the rule depends on timings, so a seeded sampled request is distributed exactly as the target but
need not repeat the same tokens run to run.
"""

from __future__ import annotations

from dataclasses import replace

from specdec.acceptance import Acceptance, ProposalRate
from specdec.k_schedule import ScheduledK
from specdec.metrics import BatchMetrics
from specdec.sequence import Sequence
from specdec.step_cost import OUTLIER, Calibration, CostModel, LineFit, StepCost, tokens_fed

AUTO = "auto"
DEFAULT_MAX_SPECULATIVE_TOKENS = 8
PRIOR_ACCEPTANCE = 0.7  # the first sequence's prior per position, before anything was measured
PROBE_DRAFT = 2  # tokens per row on a probe step while speculation is off
FAR_ABOVE = 1.25  # calibrated predicted speedup above which speculation is far from being switched off
FAR_PROBES = 32  # there, the probe period doubles per probe up to FAR_PROBES * probe_every steps
FAR_BELOW_PROBES = 8  # speculation off and a probe predicted below 1 / FAR_ABOVE: its period doubles up to this
GUARD_EVIDENCE = 2.5  # decayed steps of each kind the calibration needs at a row count before it applies
SHAPE_EVIDENCE = 1.5  # decayed timed steps of one shape (two) before its measured mean replaces the line there
SHAPE_TOLERANCE = 0.1  # a shape's measured mean this far off the line or farther replaces it (closer is noise)
SHAPE_MEMORY = 1024  # steps after which a shape's measurement not renewed is forgotten
HOLD_MAX = 8  # steps a decision of every row at its most, far ahead, is held at most
HOLD_DRAFT_SHARE = 0.1  # ... where drafting the most costs less than this share of a plain step
COST_REFRESH = 4  # measured steps between refits of the cost model


class FixedK:
    """Every row drafts ``k`` tokens (fewer when its budget says so)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self, seqs: list[Sequence], limits: list[int]) -> list[int]:
        """Tokens to draft per row; ``limits[b]`` is the most row ``b`` may draft this step."""
        return [min(self.k, limit) for limit in limits]

    def observe(self, seqs: list[Sequence], num_drafted: list[int], num_accepted: list[int], step: StepCost) -> None:
        """A fixed k learns nothing."""

    def release(self, seq: Sequence) -> None:
        """Nothing is kept per sequence."""

    def bind_metrics(self, metrics: BatchMetrics) -> None:
        """A fixed k has no choices to count."""


def choose_ks(rates: list[list[float]], limits: list[int], cost: CostModel, padded: bool = False,
              proposing: list[float] | None = None) -> tuple[list[int], float]:
    """The ``k_b`` per row maximising predicted tokens per second, and the predicted speedup over a
    plain step of the same rows.

    ``rates[b]`` is row ``b``'s conditional acceptance per position (at least ``limits[b]`` long);
    ``proposing[b]`` (1 where not given) the probability that row ``b``'s drafter proposes a draft at
    all when asked (an n-gram lookup finds no match on some steps): a row that proposes nothing emits
    its one token and, unpadded, feeds only it. So row ``b``'s position ``i`` is worth ``p_b S_bi``
    tokens (``S_bi``: the probability it is reached and kept) for ``p_b`` tokens fed in expectation.
    For each width ``w``, the best choice of expected tokens fed takes the positions (of positions
    ``<= w``) with the largest ``S_bi``, worth the most per token fed; ``S`` falls along a row, so this
    is a prefix of every row (the cost of a fractional number of tokens fed is interpolated between
    its neighbours). ``padded``: the target's forward costs ``rows x (w + 1)`` tokens whatever each row
    drafts (its grid pads rows to the longest, a row without a draft included), so at width ``w``
    every row drafts up to ``w``.
    """
    rows = len(limits)
    proposing = proposing or [1.0] * rows
    if rows == 1:  # one row: its width is its count, so the widths are the only choices
        return _choose_k(rates[0], limits[0], cost, proposing[0])
    if padded:
        return _choose_width(rates, limits, cost, proposing)
    gains = []  # (minus the probability the token is kept if drafted, position, row)
    for b, limit in enumerate(limits):
        survive = 1.0
        for i in range(limit):
            survive *= rates[b][i]
            gains.append((-survive, i + 1, b))
    gains.sort()
    widest = max(limits, default=0)
    target = cost.target_curve(rows, rows * (widest + 1))  # [tokens - rows]
    plain = rows / target[0]
    best, best_w, best_m = plain, 0, 0
    for w in range(1, widest + 1):
        tokens, fed, count, drafting = float(rows), 0.0, 0, cost.draft_fixed + cost.draft * w
        for gain, position, b in gains:
            if position > w:
                continue
            tokens -= gain * proposing[b]
            fed += proposing[b]
            count += 1
            low = int(fed)  # the cost between those of its neighbouring whole numbers of tokens
            seconds = target[low] + (fed - low) * (target[min(low + 1, len(target) - 1)] - target[low])
            rate = tokens / ((seconds + drafting) * cost.drafting_scale)
            if rate > best:
                best, best_w, best_m = rate, w, count
    ks = [0] * rows
    taken = 0
    for _, position, b in gains:
        if taken == best_m:
            break
        if position <= best_w:
            ks[b] += 1
            taken += 1
    return ks, best / plain


def predicted_speedup(rates: list[list[float]], ks: list[int], cost: CostModel, padded: bool = False,
                      proposing: list[float] | None = None) -> float:
    """The predicted tokens per second of a step drafting ``ks[b]`` tokens on row ``b`` over a plain step
    of the same rows (1 where nothing is drafted); ``rates``, ``cost``, ``padded`` and ``proposing`` as in
    :func:`choose_ks`, whose choice this prices (a fractional number of tokens fed is interpolated)."""
    rows, width = len(ks), max(ks, default=0)
    if not width:
        return 1.0
    proposing = proposing or [1.0] * rows
    tokens, fed = float(rows), float(rows)
    for b, k in enumerate(ks):
        survive = 1.0
        for i in range(k):
            survive *= rates[b][i]
            tokens += proposing[b] * survive
        fed += proposing[b] * k
    if padded:
        fed = float(rows * (width + 1))
    low = int(fed)
    target = cost.target_seconds(low)
    target += (fed - low) * (cost.target_seconds(low + 1) - target)
    return tokens / cost.with_drafting(target, width) * cost.target_seconds(rows) / rows


def _choose_width(rates: list[list[float]], limits: list[int], cost: CostModel,
                  proposing: list[float]) -> tuple[list[int], float]:
    """:func:`choose_ks` on a padded grid of several rows: a step of width ``w`` costs the same whichever
    rows draft, so every row drafts up to ``w`` (each position adds tokens for nothing more) and only
    the width is chosen, in ``O(rows x width)``: width ``w`` adds ``sum_b p_b S_bw`` tokens."""
    rows, widest = len(limits), max(limits, default=0)
    added = [0.0] * (widest + 1)  # [w]: expected tokens position w adds over the rows
    for b, limit in enumerate(limits):
        survive, p, row = 1.0, proposing[b], rates[b]
        for i in range(limit):
            survive *= row[i]
            added[i + 1] += p * survive
    target = [cost.target_seconds(rows * (w + 1)) for w in range(widest + 1)]  # [w]: the padded grid's cost
    plain = rows / target[0]
    best, best_w, tokens = plain, 0, float(rows)
    for w in range(1, widest + 1):
        tokens += added[w]
        rate = tokens / cost.with_drafting(target[w], w)
        if rate > best:
            best, best_w = rate, w
    return [min(best_w, limit) for limit in limits], best / plain


def _choose_k(rates: list[float], limit: int, cost: CostModel, proposing: float = 1.0) -> tuple[list[int], float]:
    """:func:`choose_ks` for a single row (padded or not: one row's grid is its draft). With probability
    ``1 - proposing`` the step is plain whatever k is (nothing proposed)."""
    target = cost.target_curve(1, limit + 1)  # [tokens - 1]
    plain = 1.0 / target[0]
    best, best_k, survive, tokens = plain, 0, 1.0, 1.0
    fixed, per_position, scale = cost.draft_fixed, cost.draft, cost.drafting_scale
    unproposed = (1.0 - proposing) * target[0]  # the expected seconds of the steps that stay plain
    for k in range(1, limit + 1):
        survive *= rates[k - 1]
        tokens += survive * proposing
        rate = tokens / (proposing * (target[k] + fixed + per_position * k) * scale + unproposed)
        if rate > best:
            best, best_k = rate, k
    return [best_k], best / plain


class AdaptiveK:
    """``num_speculative_tokens="auto"``: per row and step, the k the measured model predicts to be
    fastest, at most ``max_k`` (see the module docstring)."""

    def __init__(self, max_k: int, probe_every: int = 16, seq_decay: float = 0.9, pool_decay: float = 0.99,
                 cost_decay: float = 0.95, draft_decay: float = 0.9, guard_decay: float = 0.9,
                 shape_decay: float = 0.9, padded: bool = False) -> None:
        self.max_k, self.probe_every, self.seq_decay, self.padded = max_k, probe_every, seq_decay, padded
        self.pool = Acceptance(max_k, pool_decay, prior_weight=1.0, carry=True)
        self.prior = [PRIOR_ACCEPTANCE] * max_k  # the pool's, before anything was measured
        self.target = LineFit(cost_decay)
        self.drafting = LineFit(draft_decay)  # drafting seconds against width, over drafting steps
        self.seqs: dict[str, Acceptance] = {}
        self.pool_proposals = ProposalRate(pool_decay, prior_weight=1.0)  # prior 1: a drafter proposes
        self.proposals: dict[str, ProposalRate] = {}  # per sequence, the pool's rate as prior
        self.asked: list[int] = []  # the ks of the step chosen last, row by row
        self.seen: set[tuple[int, int, int]] = set()  # (rows, tokens, width) of steps timed so far
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

    def choose(self, seqs: list[Sequence], limits: list[int]) -> list[int]:
        """Tokens to draft per row; ``limits[b]`` is the most row ``b`` may draft this step."""
        limits = [min(self.max_k, limit) for limit in limits]
        self.steps += 1
        if not any(limits):  # no row may draft (every one is at its last token): nothing to choose or probe
            self.asked = [0] * len(limits)
            return self.asked
        if self.held and len(seqs) == self.held_rows and self.steps < min(self.next_probe, self.next_narrow):
            self.held -= 1
            return self._count(seqs, limits, limits)
        cost = self._model(len(seqs))
        if cost is None:  # cold start: measure a drafting step, then a plain one
            return self._count(seqs, limits, limits if self.draft_cost() is None else [0] * len(limits))
        pool = self.pool.rates(self.prior)
        rates = [self._acceptance(s).rates(pool) for s in seqs]
        model, scale = cost, self.drafting_scale(len(seqs))
        if scale is not None:
            cost = replace(cost, drafting_scale=scale)
        pooled = self.pool_proposals.rate(1.0)
        proposing = [self._proposing(s).rate(pooled) for s in seqs]
        ks, self.last_speedup = choose_ks(rates, limits, cost, self.padded, proposing)
        far = scale is not None and self.last_speedup > FAR_ABOVE  # far from switching speculation off
        probe = [min(PROBE_DRAFT, limit) for limit in limits]
        below = not any(ks) and predicted_speedup(rates, probe, model, self.padded, proposing) < 1 / FAR_ABOVE
        free = cost.draft_fixed + cost.draft * max(ks) < HOLD_DRAFT_SHARE * cost.target_seconds(len(ks))
        if far and free and ks == limits and self._measured(len(ks), self._fed(ks)):  # held, longer each time
            self.hold_period = min(2 * self.hold_period, HOLD_MAX)
            self.held, self.held_rows = self.hold_period - 1, len(ks)
        else:
            self.hold_period, self.held = 1, 0
        if not (far or below):  # near the switch (or uncalibrated): probe every probe_every steps again
            self.probe_period = self.probe_every
            self.next_probe = min(self.next_probe, self.steps + self.probe_every)
        if self.steps >= self.next_probe:  # invert the decision once
            if not any(ks):
                ks = probe
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
        return self._count(seqs, limits, ks)

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
        for s, k, n, a in zip(seqs, asked, num_drafted, num_accepted):
            if k:  # asked to draft: whether it proposed anything
                self._proposing(s).update(n > 0)
                self.pool_proposals.update(n > 0)
            if n:
                self._acceptance(s).update(n, a)
                self.pool.update(n, a)
        last_width, self.last_width = self.last_width, step.width
        if step.prompt_tokens or step.setup:  # prompt chunks fed, or a one-time set-up: not its shape's time
            return
        shape = (len(seqs), step.num_tokens, step.width)
        if shape not in self.seen:  # the first step of a shape pays one-time set-up (kernels, graphs)
            self.seen.add(shape)
            return
        cost = self._model(len(seqs))
        self.measured += 1
        if not step.width:
            self.last_plain[len(seqs)] = self.steps
        if cost is None or self.measured % COST_REFRESH == 0:
            self._costs.clear()
        target = step.target_seconds
        if cost is not None:
            predicted = cost.target_seconds(step.num_tokens)
            # The calibration: everything the step cost, the drafter's catch-up included.
            kinds = self.calibration.get(len(seqs))
            if kinds is None:
                kinds = self.calibration[len(seqs)] = (Calibration(self.guard_decay), Calibration(self.guard_decay))
            plain, drafting = kinds
            (drafting if step.width else plain).add(step.target_seconds + step.draft_seconds,
                                                    cost.with_drafting(predicted, step.width))
            target = min(target, OUTLIER * predicted)  # a hiccup of the machine counts as at most OUTLIER times
        self.target.add(step.num_tokens, target)
        shapes = self.shapes.setdefault(len(seqs), {})
        weight, seconds, _ = shapes.get(step.num_tokens, (0.0, 0.0, 0))
        shapes[step.num_tokens] = (weight * self.shape_decay + 1.0, seconds * self.shape_decay + target, self.steps)
        # After a step without drafts the drafter first catches up on the tokens it missed: not the
        # cost of a drafting step in the steady state.
        if step.width and last_width:
            draft = (cost.draft_fixed, cost.draft) if cost is not None else self.draft_cost()
            seconds = step.draft_seconds
            if draft is not None:
                seconds = min(seconds, OUTLIER * (draft[0] + draft[1] * step.width))
            self.drafting.add(step.width, seconds)

    def release(self, seq: Sequence) -> None:
        self.seqs.pop(seq.request_id, None)
        self.proposals.pop(seq.request_id, None)


def make_policy(num_speculative_tokens: int | str, max_k: int, padded: bool = False,
                schedule: tuple[tuple[int, int], ...] | None = None) -> FixedK | AdaptiveK | ScheduledK:
    """The policy of a ``num_speculative_tokens`` setting: ``"auto"`` (at most ``max_k``; ``padded``:
    the target's forward pads every row to the longest, see :class:`AdaptiveK`) or a fixed k; a
    ``num_speculative_tokens_per_batch_size`` ``schedule`` (:mod:`specdec.k_schedule`) overrides both."""
    if schedule is not None:
        return ScheduledK(schedule)
    return AdaptiveK(max_k, padded=padded) if num_speculative_tokens == AUTO else FixedK(max_k)
