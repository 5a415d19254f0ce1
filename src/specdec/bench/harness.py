"""Scheduling, greedy checks and aggregation of a benchmark run.

A *unit* is one question under one seed and one repeat. Every method runs every unit; the
order of the methods rotates from one unit to the next so that no method always runs first
(or always right after another). Before any timing, each method runs ``warmup`` untimed
generations. Within a unit a method generates turn after turn, each turn's answer becoming
part of the next turn's prompt.

With greedy decoding every output is compared token for token with the output of ``plain``
(specdec's plain decoding, the reference) on the same unit and turn; a difference is a
*mismatch*, counted per method.

Aggregates, per method and per category (and ``overall``), are computed from totals:
tokens/s is total generated tokens over total wall-clock seconds, speedup is that over plain
decoding's tokens/s, τ and α come from the merged :class:`~specdec.metrics.RequestMetrics`.
The cost ratio is

    c = (time_drafting / num_draft_tokens) / (time_target / num_steps)

the drafting time per drafted token over the target time per step. For ``draft_model`` each
drafted token costs exactly one draft forward, so c is the time of one draft forward over the
time of one target (verification) forward, the quantity in the predicted speedup
``S = (1 - α^(k+1)) / ((1 - α)(k c + 1))``; efficiency is measured speedup / S. A caller may
pass directly measured cost ratios instead (see :func:`specdec.bench.runners.direct_cost_ratio`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from specdec.errors import SpecDecError
from specdec.metrics import RequestMetrics

if TYPE_CHECKING:
    from specdec.bench.runners import Runner
    from specdec.bench.workloads import Question

REFERENCE = "plain"
OVERALL = "overall"


@dataclass(frozen=True)
class MethodKind:
    """What a method is: run once per k (``speculative``), needs a draft model, is a transformers peer."""

    description: str
    speculative: bool = False
    needs_draft: bool = False
    peer: bool = False


METHODS: dict[str, MethodKind] = {
    "plain": MethodKind("specdec plain decoding (the reference)"),
    "draft_model": MethodKind("specdec, draft model drafter", speculative=True, needs_draft=True),
    "ngram": MethodKind("specdec, n-gram prompt lookup drafter", speculative=True),
    "hf": MethodKind("transformers generate", peer=True),
    "hf_assisted": MethodKind(
        "transformers generate, assistant_model with num_assistant_tokens=k, constant schedule, "
        "assistant_confidence_threshold=0 (set on the assistant's generation_config)",
        speculative=True,
        needs_draft=True,
        peer=True,
    ),
    "hf_assisted_default": MethodKind(
        "transformers generate, assistant_model with its generation_config as loaded; unset fields take "
        "transformers' defaults (5.x: 20 tokens, constant schedule, confidence threshold 0.4)",
        needs_draft=True,
        peer=True,
    ),
    "hf_prompt_lookup": MethodKind(
        "transformers generate, prompt_lookup_num_tokens=k, max_matching_ngram_size=prompt_lookup_max",
        speculative=True,
        peer=True,
    ),
}


@dataclass(frozen=True)
class MethodSpec:
    """One benchmarked configuration: a method name and, for speculative methods, its k."""

    method: str
    k: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpecDecError(f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        if METHODS[self.method].speculative != (self.k is not None):
            raise SpecDecError(f"method {self.method!r} {'needs' if self.k is None else 'takes no'} k")

    @property
    def label(self) -> str:
        return self.method if self.k is None else f"{self.method} k={self.k}"

    @property
    def kind(self) -> MethodKind:
        return METHODS[self.method]


def expand_methods(names: Sequence[str], ks: Sequence[int]) -> list[MethodSpec]:
    """One spec per non-speculative method and one per (speculative method, k); ``plain`` always first."""
    from specdec.drafters.base import MAX_SPECULATIVE_TOKENS

    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise SpecDecError(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    if not ks:
        raise SpecDecError("give at least one k")
    bad = [k for k in ks if not 1 <= k <= MAX_SPECULATIVE_TOKENS]
    if bad:
        raise SpecDecError(f"k must be in 1..{MAX_SPECULATIVE_TOKENS}, got {bad}")
    specs = [MethodSpec(REFERENCE)]
    for name in dict.fromkeys(names):
        if name == REFERENCE:
            continue
        if METHODS[name].speculative:
            specs.extend(MethodSpec(name, k) for k in dict.fromkeys(ks))
        else:
            specs.append(MethodSpec(name))
    return specs


def predicted_speedup(alpha: float, k: int, c: float) -> float:
    """Expected speedup of k-token speculation with i.i.d. acceptance ``alpha`` and cost ratio ``c``:
    ``(1 - alpha^(k+1)) / ((1 - alpha)(k c + 1))`` (its limit ``(k+1)/(k c+1)`` at alpha = 1)."""
    if not 0.0 <= alpha <= 1.0:
        raise SpecDecError(f"acceptance rate must be in [0, 1], got {alpha}")
    if k < 1 or c < 0:
        raise SpecDecError(f"need k >= 1 and c >= 0, got k={k}, c={c}")
    expected_tokens = k + 1 if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    return expected_tokens / (k * c + 1.0)


def metrics_cost_ratio(metrics: RequestMetrics) -> float | None:
    """``(time_drafting / num_draft_tokens) / (time_target / num_steps)``, None when nothing was drafted."""
    if not metrics.num_draft_tokens or not metrics.num_steps or metrics.time_target <= 0:
        return None
    return (metrics.time_drafting / metrics.num_draft_tokens) / (metrics.time_target / metrics.num_steps)


@dataclass
class BenchSettings:
    """How every method runs: tokens per turn, temperature, seeds, repeats, warm-up runs, context window."""

    max_tokens: int
    temperature: float = 0.0
    seeds: tuple[int, ...] = (0,)
    repeats: int = 1
    warmup: int = 1
    context_window: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SpecDecError(f"max tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise SpecDecError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not self.seeds:
            raise SpecDecError("give at least one seed")
        if self.repeats < 1:
            raise SpecDecError(f"repeats must be >= 1, got {self.repeats}")
        if self.warmup < 0:
            raise SpecDecError(f"warm-up runs must be >= 0, got {self.warmup}")
        self.seeds = tuple(self.seeds)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Measurement:
    """One timed generation: a turn of a question, under one method, seed and repeat."""

    question_id: str
    category: str
    turn: int
    seed: int
    repeat: int
    method: str
    order: int
    prompt_tokens: int
    token_ids: list[int]
    seconds: float
    metrics: RequestMetrics | None
    matches_reference: bool | None = None
    first_mismatch: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "question_id": self.question_id,
            "category": self.category,
            "turn": self.turn,
            "seed": self.seed,
            "repeat": self.repeat,
            "method": self.method,
            "order": self.order,
            "prompt_tokens": self.prompt_tokens,
            "num_tokens": len(self.token_ids),
            "seconds": self.seconds,
            "tokens_per_second": len(self.token_ids) / self.seconds if self.seconds > 0 else None,
            "matches_reference": self.matches_reference,
            "first_mismatch": self.first_mismatch,
            "metrics": self.metrics.to_dict() if self.metrics is not None else None,
            "token_ids": self.token_ids,
        }


@dataclass
class SummaryRow:
    """Aggregates of one method over one category (or ``overall``)."""

    label: str
    method: str
    k: int | None
    category: str
    num_generations: int
    num_tokens: int
    seconds: float
    tokens_per_second: float | None
    speedup: float | None
    tau: float | None
    alpha: float | None
    acceptance_per_position: list[float] | None
    cost_ratio: float | None
    predicted_speedup: float | None
    efficiency: float | None
    mismatches: int | None
    checked: int


@dataclass
class BenchResult:
    """Everything a run produced: settings, method descriptions, raw measurements, aggregates."""

    settings: BenchSettings
    methods: list[dict[str, Any]]
    measurements: list[Measurement]
    summary: list[SummaryRow]
    skipped: list[dict[str, Any]] = field(default_factory=list)
    cost_ratios: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def mismatches(self) -> dict[str, int]:
        """Greedy mismatches per method label (only methods with at least one)."""
        return {r.label: r.mismatches for r in self.summary if r.category == OVERALL and r.mismatches}


class PromptSource(Protocol):
    """What the harness needs from a prompt builder (see :class:`specdec.bench.workloads.PromptBuilder`)."""

    def build(self, turns: Sequence[str], answers: Sequence[str]) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


def _fits(prompt_ids: list[int], settings: BenchSettings) -> bool:
    return settings.context_window is None or len(prompt_ids) + settings.max_tokens <= settings.context_window


def _warm_up(
    runners: Sequence[Runner], questions: Sequence[Question], prompts: PromptSource, settings: BenchSettings
) -> None:
    if not settings.warmup:
        return
    for question in questions:
        prompt_ids = prompts.build(question.turns[:1], [])
        if _fits(prompt_ids, settings):
            break
    else:
        raise SpecDecError(
            f"no question's first turn fits in the context window ({settings.context_window} tokens) "
            f"with {settings.max_tokens} new tokens; lower --max-tokens"
        )
    for runner in runners:
        for _ in range(settings.warmup):
            runner.run(prompt_ids, settings.max_tokens, settings.temperature, settings.seeds[0])


def _check_against_reference(unit: list[Measurement]) -> None:
    """Mark each measurement of a unit as matching the reference output of the same turn, or not."""
    reference = {m.turn: m.token_ids for m in unit if m.method == REFERENCE}
    for m in unit:
        expected = reference.get(m.turn)
        if m.method == REFERENCE or expected is None:
            continue
        m.matches_reference = m.token_ids == expected
        if not m.matches_reference:
            m.first_mismatch = next(
                (i for i, (a, b) in enumerate(zip(m.token_ids, expected, strict=False)) if a != b),
                min(len(m.token_ids), len(expected)),
            )


def _run_question(
    runner: Runner,
    question: Question,
    seed: int,
    repeat: int,
    order: int,
    prompts: PromptSource,
    settings: BenchSettings,
    skipped: list[dict[str, Any]],
) -> list[Measurement]:
    """Generate every turn of ``question``, each answer becoming part of the next turn's prompt.
    A turn whose prompt does not fit the context window is recorded in ``skipped`` and ends the question."""
    done: list[Measurement] = []
    answers: list[str] = []
    for turn in range(len(question.turns)):
        prompt_ids = prompts.build(question.turns[: turn + 1], answers)
        if not _fits(prompt_ids, settings):
            skipped.append(
                {
                    "question_id": question.question_id,
                    "turn": turn,
                    "seed": seed,
                    "repeat": repeat,
                    "method": runner.spec.label,
                    "prompt_tokens": len(prompt_ids),
                }
            )
            break
        token_ids, seconds, metrics = runner.run(prompt_ids, settings.max_tokens, settings.temperature, seed)
        done.append(
            Measurement(
                question_id=question.question_id,
                category=question.category,
                turn=turn,
                seed=seed,
                repeat=repeat,
                method=runner.spec.label,
                order=order,
                prompt_tokens=len(prompt_ids),
                token_ids=list(token_ids),
                seconds=seconds,
                metrics=metrics,
            )
        )
        answers.append(prompts.decode(token_ids))
    return done


def run_benchmark(
    runners: Sequence[Runner],
    questions: Sequence[Question],
    prompts: PromptSource,
    settings: BenchSettings,
    cost_ratios: dict[str, float] | None = None,
    progress: bool = True,
) -> BenchResult:
    """Warm up, then run every (question, seed, repeat) unit with every runner in rotating order.

    Exactly one runner must be ``plain``: it is the reference for speedups and greedy checks.
    ``cost_ratios`` (label -> c) replaces the metrics-based cost ratio of those methods.
    """
    from tqdm.auto import tqdm

    if [r.spec.method for r in runners].count(REFERENCE) != 1:
        raise SpecDecError(f"the benchmark needs exactly one {REFERENCE!r} runner, the reference")
    if not questions:
        raise SpecDecError("the benchmark needs at least one question")
    _warm_up(runners, questions, prompts, settings)

    measurements: list[Measurement] = []
    skipped: list[dict[str, Any]] = []
    units = [(q, seed, rep) for q in questions for seed in settings.seeds for rep in range(settings.repeats)]
    with tqdm(total=len(units) * len(runners), desc="bench", unit="run", disable=not progress) as bar:
        for index, (question, seed, repeat) in enumerate(units):
            shift = index % len(runners)
            unit: list[Measurement] = []
            for order, runner in enumerate([*runners[shift:], *runners[:shift]]):
                unit += _run_question(runner, question, seed, repeat, order, prompts, settings, skipped)
                bar.update(1)
            if settings.greedy:
                _check_against_reference(unit)
            measurements.extend(unit)
    specs = [r.spec for r in runners]
    summary = summarize(measurements, specs, settings.greedy, cost_ratios or {})
    return BenchResult(
        settings, [r.describe() for r in runners], measurements, summary, skipped, dict(cost_ratios or {})
    )


def _row(
    spec: MethodSpec,
    category: str,
    group: list[Measurement],
    reference_tps: float | None,
    greedy: bool,
    cost_ratios: dict[str, float],
) -> SummaryRow:
    tokens = sum(len(m.token_ids) for m in group)
    seconds = sum(m.seconds for m in group)
    tps = tokens / seconds if seconds > 0 else None
    speedup = tps / reference_tps if tps is not None and reference_tps else None
    merged: RequestMetrics | None = None
    if group and all(m.metrics is not None for m in group):
        merged = RequestMetrics()
        for m in group:
            merged.merge(m.metrics)
    drafted = merged is not None and merged.num_draft_tokens > 0
    tau = merged.mean_acceptance_length if merged is not None and merged.num_steps else None
    alpha = merged.acceptance_rate if drafted else None
    per_position = merged.acceptance_rate_per_position if drafted else None
    c = cost_ratios.get(spec.label, metrics_cost_ratio(merged) if drafted else None)
    predicted = (
        predicted_speedup(alpha, spec.k, c) if alpha is not None and c is not None and spec.k else None
    )
    efficiency = speedup / predicted if speedup is not None and predicted else None
    checked = [m for m in group if m.matches_reference is not None]
    mismatches = (
        sum(not m.matches_reference for m in checked) if greedy and spec.method != REFERENCE else None
    )
    return SummaryRow(
        spec.label,
        spec.method,
        spec.k,
        category,
        len(group),
        tokens,
        seconds,
        tps,
        speedup,
        tau,
        alpha,
        per_position,
        c,
        predicted,
        efficiency,
        mismatches,
        len(checked),
    )


def summarize(
    measurements: Sequence[Measurement],
    specs: Sequence[MethodSpec],
    greedy: bool,
    cost_ratios: dict[str, float] | None = None,
) -> list[SummaryRow]:
    """One row per method per category, then one per method for ``overall``."""
    cost_ratios = cost_ratios or {}
    categories = list(dict.fromkeys(m.category for m in measurements))
    rows = []
    for category in [*categories, OVERALL]:
        in_category = [m for m in measurements if category in (OVERALL, m.category)]
        reference = [m for m in in_category if m.method == REFERENCE]
        ref_seconds = sum(m.seconds for m in reference)
        reference_tps = sum(len(m.token_ids) for m in reference) / ref_seconds if ref_seconds > 0 else None
        for spec in specs:
            group = [m for m in in_category if m.method == spec.label]
            rows.append(_row(spec, category, group, reference_tps, greedy, cost_ratios))
    return rows
