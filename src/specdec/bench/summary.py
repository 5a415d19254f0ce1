"""Aggregates of a benchmark run, per batch size, method and category (and ``overall``).

Computed from totals. With ``seconds`` the wall-clock time of the generate calls (each call
counted once, whatever the number of requests in it):

- throughput (tok/s) = generated tokens / seconds; speedup = that over plain decoding's
  throughput at the same batch size, on the same prompts (a method in deterministic mode: over plain
  decoding in deterministic mode, when the run has it; see :func:`~specdec.bench.methods.reference_label`);
- deterministic cost (a deterministic variant run beside its default twin, ``bench --deterministic
  both``) = the twin's throughput / the variant's, at the same batch size on the same prompts: the
  time the mode costs (above 1: slower);
- per-request tok/s = the mean over requests of (request's tokens / its call's seconds);
- per prompt: a request's speedup is its tok/s over plain decoding's on the same prompt (question,
  turn, seed and repeat); rows report the median over prompts with the min and max, which one slow
  call cannot drag the way it drags the totals; ``tokens_per_second_spread`` is the max / min of
  the per-request tok/s, and plain decoding's (which does the same work per token on every
  prompt) above :data:`UNRELIABLE_SPREAD` marks the timings as unreliable;
- τ and α come from the merged :class:`~specdec.metrics.RequestMetrics`, and so do a cascade's inner α (the
  middle model's acceptance of the small model's drafts) and, with ``"auto"`` k, the policy's choices
  (``k_choices``: steps per chosen k, 0 = speculation off for the request's step);
- the cost ratio ``c = (time_drafting / num_draft_tokens) / (time_target / num_steps)``, the
  drafting time per drafted token over the target time per step. For ``draft_model`` each
  drafted token costs one draft forward, so c is one draft forward over one target
  (verification) forward, the quantity in the predicted speedup
  ``S = (1 - α^(k+1)) / ((1 - α)(k c + 1))``; efficiency is measured speedup / S. A
  :class:`Calibration` may carry directly measured cost ratios instead;
- with a draft equal to the target, the ideal speedup ``(k+1) / (k + t(k+1)/t(1))`` (``t(n)``
  the time of one n-token target forward at batch 1), from the :class:`Calibration`;
- for plain decoding, steps/s (every step emits one token per request: a call's steps are its
  longest output) and, given the least time a step can take (parameter bytes / memory
  bandwidth), the roofline fraction = steps/s × that time, i.e. achieved bytes/s over bandwidth.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdec.bench.methods import REFERENCE, MethodSpec, reference_label
from specdec.errors import SpecDecError

if TYPE_CHECKING:
    from specdec.bench.measurement import Measurement
    from specdec.metrics import RequestMetrics

OVERALL = "overall"
UNRELIABLE_SPREAD = 1.5
"""Plain decoding's per-request tok/s varying by more than this factor marks a run's timings unreliable."""


@dataclass
class Calibration:
    """Numbers measured beside the runs: ``cost_ratios`` (label -> c timed directly),
    ``forward_seconds`` (n -> seconds of one n-token target forward at batch 1),
    ``ideal_ratios`` (label -> ideal speedup when the draft is the target) and
    ``min_step_seconds`` (parameter bytes / memory bandwidth; None when the bandwidth is unknown)."""

    cost_ratios: dict[str, float] = field(default_factory=dict)
    forward_seconds: dict[int, float] = field(default_factory=dict)
    ideal_ratios: dict[str, float] = field(default_factory=dict)
    min_step_seconds: float | None = None


def predicted_speedup(alpha: float, k: int, c: float) -> float:
    """Expected speedup of k-token speculation with i.i.d. acceptance ``alpha`` and cost ratio ``c``:
    ``(1 - alpha^(k+1)) / ((1 - alpha)(k c + 1))`` (its limit ``(k+1)/(k c+1)`` at alpha = 1)."""
    if not 0.0 <= alpha <= 1.0:
        raise SpecDecError(f"acceptance rate must be in [0, 1], got {alpha}")
    if k < 1 or c < 0:
        raise SpecDecError(f"need k >= 1 and c >= 0, got k={k}, c={c}")
    expected_tokens = k + 1 if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    return expected_tokens / (k * c + 1.0)


def ideal_ratio(k: int, t1: float, tk1: float) -> float:
    """Tokens/s of k-token speculation with a draft equal to the target (all drafts accepted) over
    plain decoding: ``(k+1) / (k + t(k+1)/t(1))``, with ``t1`` = t(1) and ``tk1`` = t(k+1) the
    seconds of a 1-token and a (k+1)-token target forward (k draft forwards, one verification)."""
    if k < 1 or t1 <= 0 or tk1 <= 0:
        raise SpecDecError(f"need k >= 1 and positive forward times, got k={k}, t(1)={t1}, t(k+1)={tk1}")
    return (k + 1) / (k + tk1 / t1)


def metrics_cost_ratio(metrics: RequestMetrics) -> float | None:
    """``(time_drafting / num_draft_tokens) / (time_target / num_steps)``, None when nothing was drafted."""
    if not metrics.num_draft_tokens or not metrics.num_steps or metrics.time_target <= 0:
        return None
    return (metrics.time_drafting / metrics.num_draft_tokens) / (metrics.time_target / metrics.num_steps)


@dataclass
class SummaryRow:
    """Aggregates of one method at one batch size over one category (or ``overall``); see the module doc."""

    label: str
    method: str
    k: int | str | None
    batch_size: int
    category: str
    num_generations: int
    num_calls: int
    num_tokens: int
    seconds: float
    tokens_per_second: float | None
    request_tokens_per_second: float | None
    speedup: float | None
    tau: float | None
    alpha: float | None
    acceptance_per_position: list[float] | None
    cost_ratio: float | None
    predicted_speedup: float | None
    efficiency: float | None
    ideal_speedup: float | None
    steps_per_second: float | None
    roofline: float | None
    mismatches: int | None
    checked: int
    ties: int | None = None
    speedup_median: float | None = None
    speedup_min: float | None = None
    speedup_max: float | None = None
    tokens_per_second_spread: float | None = None
    inner_alpha: float | None = None
    k_choices: dict[int, int] | None = None
    deterministic: bool = False
    deterministic_cost: float | None = None


def _prompt_key(m: Measurement) -> tuple:
    return (m.question_id, m.turn, m.seed, m.repeat)


def _request_tps(m: Measurement) -> float | None:
    return len(m.token_ids) / m.seconds if m.seconds > 0 else None


def median(values: Sequence[float]) -> float:
    """The median of a non-empty list."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _call_seconds(group: Sequence[Measurement]) -> dict[int, float]:
    return {m.call: m.seconds for m in group}


def _merged_metrics(group: Sequence[Measurement]) -> RequestMetrics | None:
    if not group or any(m.metrics is None for m in group):
        return None
    from specdec.metrics import RequestMetrics

    merged = RequestMetrics()
    for m in group:
        merged.merge(m.metrics)
    return merged


def _row(
    spec: MethodSpec,
    batch_size: int,
    category: str,
    group: list[Measurement],
    reference_tps: float | None,
    greedy: bool,
    calibration: Calibration,
    reference_by_prompt: dict[tuple, float],
) -> SummaryRow:
    tokens = sum(len(m.token_ids) for m in group)
    call_seconds = _call_seconds(group)
    seconds = sum(call_seconds.values())
    tps = tokens / seconds if seconds > 0 else None
    per_request = [len(m.token_ids) / m.seconds for m in group if m.seconds > 0]
    request_tps = sum(per_request) / len(per_request) if per_request else None
    speedup = tps / reference_tps if tps is not None and reference_tps else None
    merged = _merged_metrics(group)
    drafted = merged is not None and merged.num_draft_tokens > 0
    tau = merged.mean_acceptance_length if merged is not None and merged.num_steps else None
    alpha = merged.acceptance_rate if drafted else None
    per_position = merged.acceptance_rate_per_position if drafted else None
    c = calibration.cost_ratios.get(spec.label, metrics_cost_ratio(merged) if drafted else None)
    fixed_k = isinstance(spec.k, int)  # no single k to predict from under "auto"
    predicted = predicted_speedup(alpha, spec.k, c) if alpha is not None and c is not None and fixed_k else None
    efficiency = speedup / predicted if speedup is not None and predicted else None
    steps_per_second = roofline = None
    if spec.method == REFERENCE and seconds > 0:
        steps: dict[int, int] = {}
        for m in group:
            steps[m.call] = max(steps.get(m.call, 0), len(m.token_ids))
        steps_per_second = sum(steps.values()) / seconds
        if calibration.min_step_seconds is not None:
            roofline = steps_per_second * calibration.min_step_seconds
    checked = [m for m in group if m.matches_reference is not None]
    rates = [r for r in map(_request_tps, group) if r]
    spread = max(rates) / min(rates) if rates else None
    per_prompt = [
        rate / reference_by_prompt[_prompt_key(m)]
        for m in group
        if spec.method != REFERENCE and (rate := _request_tps(m)) and reference_by_prompt.get(_prompt_key(m))
    ]
    judged = greedy and spec.method != REFERENCE
    mismatches = sum(m.verdict is not None and not m.verdict.ok for m in checked) if judged else None
    ties = sum(m.verdict is not None and m.verdict.kind == "tie" for m in checked) if judged else None
    return SummaryRow(
        label=spec.label,
        method=spec.method,
        k=spec.k,
        batch_size=batch_size,
        category=category,
        num_generations=len(group),
        num_calls=len(call_seconds),
        num_tokens=tokens,
        seconds=seconds,
        tokens_per_second=tps,
        request_tokens_per_second=request_tps,
        speedup=speedup,
        tau=tau,
        alpha=alpha,
        acceptance_per_position=per_position,
        cost_ratio=c,
        predicted_speedup=predicted,
        efficiency=efficiency,
        ideal_speedup=calibration.ideal_ratios.get(spec.label) if batch_size == 1 else None,
        steps_per_second=steps_per_second,
        roofline=roofline,
        mismatches=mismatches,
        checked=len(checked),
        ties=ties,
        speedup_median=median(per_prompt) if per_prompt else None,
        speedup_min=min(per_prompt, default=None),
        speedup_max=max(per_prompt, default=None),
        tokens_per_second_spread=spread,
        inner_alpha=merged.inner_acceptance_rate if merged is not None and merged.inner_draft_tokens else None,
        k_choices=dict(sorted(merged.k_choices.items())) if merged is not None and merged.k_choices else None,
        deterministic=spec.deterministic,
    )


def summarize(
    measurements: Sequence[Measurement],
    specs: Sequence[MethodSpec],
    greedy: bool,
    calibration: Calibration | None = None,
) -> list[SummaryRow]:
    """Per batch size (ascending): one row per method that ran at it per category, then one per method
    for ``overall``; a deterministic variant's row carries its cost against its default twin's row."""
    calibration = calibration or Calibration()
    categories = list(dict.fromkeys(m.category for m in measurements))
    rows = []
    for batch_size in sorted({m.batch_size for m in measurements}):
        at_size = [m for m in measurements if m.batch_size == batch_size]
        ran = {m.method for m in at_size}
        plains = {spec.label for spec in specs if spec.method == REFERENCE and spec.label in ran}
        for category in [*categories, OVERALL]:
            in_category = [m for m in at_size if category in (OVERALL, m.category)]
            if not in_category:
                continue
            references = {label: _reference(in_category, label) for label in plains}
            for spec in specs:
                if spec.label in ran:
                    group = [m for m in in_category if m.method == spec.label]
                    reference_tps, by_prompt = references.get(reference_label(spec.deterministic, plains),
                                                              (None, {}))
                    rows.append(_row(spec, batch_size, category, group, reference_tps, greedy, calibration,
                                     by_prompt))
    _deterministic_costs(rows, specs)
    return rows


def _reference(measurements: Sequence[Measurement], label: str) -> tuple[float | None, dict[tuple, float]]:
    """The throughput of the plain decoding labelled ``label`` among ``measurements``, and its tok/s per prompt."""
    reference = [m for m in measurements if m.method == label]
    seconds = sum(_call_seconds(reference).values())
    tps = sum(len(m.token_ids) for m in reference) / seconds if seconds > 0 else None
    return tps, {_prompt_key(m): rate for m in reference if (rate := _request_tps(m))}


def _deterministic_costs(rows: Sequence[SummaryRow], specs: Sequence[MethodSpec]) -> None:
    """Set each deterministic variant's cost: its default twin's tok/s over its own, in the same batch size
    and category (left None where the twin did not run)."""
    twins = {spec.label: spec.default_twin for spec in specs if spec.default_twin}
    by_key = {(r.batch_size, r.category, r.label): r for r in rows}
    for row in rows:
        twin = by_key.get((row.batch_size, row.category, twins.get(row.label)))
        if twin is not None and twin.tokens_per_second and row.tokens_per_second:
            row.deterministic_cost = twin.tokens_per_second / row.tokens_per_second
