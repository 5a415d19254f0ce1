"""What a step cost and the model that predicts it, for ``num_speculative_tokens="auto"``
(:mod:`specdec.adaptive`): the measured :class:`StepCost` of a step, a :class:`LineFit` of seconds
against tokens fed or draft width, a :class:`Calibration` of measured against predicted seconds at the
host's :class:`Pace`, and the :class:`CostModel` the policy chooses with."""

from __future__ import annotations

from dataclasses import dataclass

OUTLIER = 3.0  # a measured step time counts as at most this many times the predicted one
HICCUP = 1.25  # in a calibration or a shape's mean, a step counts as at most this many times what was expected


@dataclass
class StepCost:
    """What one step cost: ``num_tokens`` fed to the target (rows + drafts), ``width`` (the longest
    draft, i.e. sequential draft positions), ``target_seconds`` (target forward, verification and
    bookkeeping), ``draft_seconds`` (propose and observe), ``prompt_tokens``, the prompt chunks' tokens
    fed in the same step (:meth:`specdec.engine.Engine.step_feeding`; their time is in ``target_seconds``),
    ``prompt_fused``: whether they were fed in the step's own forward (else in forwards of their own before it),
    ``setup``: whether the step paid a one-time set-up (a CUDA graph captured, a graph compiled:
    :func:`specdec.models.cuda_graphs.one_time_setups`), whose seconds its times then hold, and
    ``catch_up_seconds``, the part of ``draft_seconds`` the drafter spent catching up on context it had not
    absorbed (:meth:`specdec.drafters.base.Drafter.catch_up`)."""

    num_tokens: int
    width: int
    target_seconds: float
    draft_seconds: float
    prompt_tokens: int = 0
    setup: bool = False
    catch_up_seconds: float = 0.0
    prompt_fused: bool = False


class LineFit:
    """``t(x) = a + b x`` by exponentially weighted least squares (``decay`` per added point)."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.sums = [0.0] * 5  # weight, Σx, Σx², Σt, Σxt

    def add(self, x: float, t: float) -> None:
        self.sums = [s * self.decay + v for s, v in zip(self.sums, (1.0, x, x * x, t, x * t))]

    @property
    def spread(self) -> bool:
        """Whether points at different x were seen (the slope is measured)."""
        w, sx, sxx = self.sums[:3]
        return w > 0 and sxx / w - (sx / w) ** 2 > 1e-6 * (1 + (sx / w) ** 2)

    def line(self) -> tuple[float, float]:
        """``(a, b)``, with ``b >= 0`` (a longer forward never costs less) and ``t(x) > 0`` at the mean x."""
        w, sx, sxx, st, sxt = self.sums
        mx, mt = sx / w, st / w
        b = max(0.0, (sxt / w - mx * mt) / (sxx / w - mx * mx)) if self.spread else 0.0
        return mt - b * mx, b


@dataclass
class Calibration:
    """Measured against predicted seconds of one kind of step, as decayed sums (``decay`` per step added), the
    measured seconds taken at the host's pace (:meth:`Pace.calibrate` divides them by it).

    A step counts as at most ``HICCUP`` times what the calibration so far expected of it (its predicted seconds
    times :meth:`ratio`): a hiccup of the machine (one step taking twice its time, which a shared 2-core host
    shows on plain and drafting steps alike) counted in full moved the ratio by a tenth, and at one stream at the
    ``1b`` shape, where a draft model's step is within a few percent of a bound of 1.25 plain steps, one such
    drafting step switched speculation off for about a hundred steps: off, drafting steps are measured only at
    probes (``docs/lab-notes/2026-11-30-probe-catch-up.md``). A cost that every step pays still moves the ratio,
    a few percent a step (each step counts up to a quarter above it, at a tenth of the weight)."""

    decay: float
    weight: float = 0.0  # decayed count of steps
    measured: float = 0.0
    predicted: float = 0.0

    def add(self, measured: float, predicted: float) -> None:
        if self.weight:  # a hiccup of the machine counts as at most HICCUP times what was expected
            measured = min(measured, HICCUP * predicted * self.ratio())
        self.weight = self.weight * self.decay + 1.0
        self.measured = self.measured * self.decay + measured
        self.predicted = self.predicted * self.decay + predicted

    def ratio(self) -> float:
        """Measured over predicted seconds (1 when nothing was measured)."""
        return self.measured / self.predicted if self.predicted > 0 else 1.0


@dataclass
class Pace:
    """How fast the host runs now, for :class:`Calibration`: a decayed mean (``decay`` per step) over the last few
    steps of every kind and row count of each step's measured over predicted seconds, divided by what its kind's
    calibration expects (:meth:`Calibration.ratio`), so that a drafting step and a plain step at the same moment
    give the same pace.

    Each step enters its calibration divided by the pace before it (:meth:`calibrate`), so the two kinds of step
    are compared over the same stretch of time: a step of the kind not running (a probe) against the steps just
    before it. Before (until 2026-12-01), each kind's ratio was its own steps' alone, whenever they ran. A slow phase
    of the host while speculating raised the drafting ratio alone, the target's line (fitted over every step) rose
    with it, and the plain steps after it then looked fast against the line: at one stream at the ``1b`` shape,
    where one draft is 6% inside a bound of 1.25, that kept speculation off for tens of steps
    (``docs/lab-notes/2026-11-30-bound-edge.md``). Now a slow phase, or the line moving, raises the pace, and
    moves a calibration only while the pace lags it, then back as the phase ends
    (``docs/lab-notes/2026-12-01-pace.md``).

    A step moves the pace by at most ``HICCUP`` times the pace (a hiccup of the host moves it a little), and only
    once its kind was measured at its row count (a first step there has no expectation to divide by)."""

    decay: float
    value: float | None = None  # None until a step was measured

    def calibrate(self, kind: Calibration, measured: float, predicted: float) -> None:
        """Add a step of ``measured`` seconds, predicted ``predicted`` by the cost model, to its ``kind``'s
        calibration at the pace now, then move the pace by it."""
        expected = kind.ratio()  # what the kind's calibration expects of the step, over its prediction
        seen = measured / predicted / expected
        known = kind.weight > 0
        if self.value is None:
            self.value = seen
        kind.add(measured / self.value, predicted)
        if known:
            seen = min(max(seen, self.value / HICCUP), self.value * HICCUP)
            self.value = self.value * self.decay + seen * (1.0 - self.decay)


@dataclass(frozen=True)
class CostModel:
    """Predicted seconds of a step: the target's part ``intercept + slope * tokens`` moved by the measured
    ``offsets``, plus ``draft_fixed + draft * width`` when it drafts (``width > 0``), the whole of a
    drafting step times ``drafting_scale`` (the calibration).

    ``offsets``: ``(tokens, measured mean − line)`` for the step shapes measured at this row count, in
    increasing tokens; a number of tokens takes the offset of the largest measured one at or below it (0 below
    the first), so a cost that jumps at a kernel's tile size (a staircase, not a line) is predicted
    from where it was measured on."""

    intercept: float
    slope: float
    draft: float
    draft_fixed: float = 0.0
    drafting_scale: float = 1.0
    offsets: tuple[tuple[int, float], ...] = ()

    def target_seconds(self, num_tokens: int) -> float:
        """The target's part of a step feeding ``num_tokens`` tokens."""
        shift = 0.0
        for tokens, offset in self.offsets:  # the largest measured number of tokens at or below it
            if tokens > num_tokens:
                break
            shift = offset
        return max(self.intercept + self.slope * num_tokens + shift, 1e-12)

    def target_curve(self, first: int, last: int) -> list[float]:
        """:meth:`target_seconds` for ``first..last`` tokens, ``[last - first + 1]``."""
        return [self.target_seconds(n) for n in range(first, last + 1)]

    def seconds(self, num_tokens: int, width: int) -> float:
        """A step feeding ``num_tokens`` tokens, ``width`` draft positions (0: a plain step)."""
        return self.with_drafting(self.target_seconds(num_tokens), width)

    def left_in_bound(self, max_step_ratio: float, rows: int, num_tokens: int, width: int) -> float:
        """What a step of ``rows`` rows feeding ``num_tokens`` tokens and ``width`` draft positions leaves of
        ``max_step_ratio`` plain steps of its rows (negative: over the bound)."""
        return max_step_ratio * self.target_seconds(rows) - self.seconds(num_tokens, width)

    def with_drafting(self, target: float, width: int) -> float:
        """A step's seconds from its target part ``target`` (:meth:`target_seconds`) and its ``width``."""
        return (target + self.draft_fixed + self.draft * width) * self.drafting_scale if width else target


def tokens_fed(num_drafted: list[int], width: int, padded: bool) -> int:
    """Tokens a step feeds the target: each row's pending token and its ``num_drafted`` drafts, or
    (``padded``: the target's grid pads every row to the widest) ``rows x (width + 1)``."""
    return len(num_drafted) * (width + 1) if padded else len(num_drafted) + sum(num_drafted)
