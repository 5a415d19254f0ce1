"""Scheduling and greedy checks of a benchmark run, at one or several batch sizes.

For each batch size ``B`` the questions of each category are cut, in order, into *groups* of
``B`` (the last group of a category may be smaller). A *unit* is one group under one seed and
one repeat. Every runner that takes ``B`` prompts at once runs every unit (transformers peers
take one: they run at batch 1 only); the order of the runners rotates from one unit to the
next so that no method always runs first (or always right after another). Before the units
of a batch size, each runner runs ``warmup`` untimed calls of ``B`` prompts. Units run in
*passes*: every group under one repeat and seed, then the next pass. A runner whose drafter
learns across requests (the suffix cache) forgets it after the warm-up and before each pass, so
every pass measures what the first did: a question is drafted from the earlier questions of its
pass, never from its own answer in an earlier repeat or seed.

Within a unit a runner generates turn after turn: turn ``t`` of every question of the group
that has one is one generate call (a batch), and each answer becomes part of that question's
next prompt. A measurement is one request: its tokens, and the wall-clock seconds of the call
it was part of (all requests of a call start together; the call ends with its last request).

With greedy decoding every output is compared token for token with the output of ``plain``
(specdec's plain decoding, the reference) for the same question and turn at the same batch
size. A difference is judged by :func:`specdec.greedy_check.check_greedy` under the reference's
target: a *tie* when the first differing tokens' logits are within the dtype's rounding there
(half precision flips such ties between kernels), else a *mismatch*; both are counted per
method, only mismatches fail the run. A method in deterministic mode (``bench --deterministic``)
is compared with plain decoding in deterministic mode (``plain det``), and there every difference
is a mismatch; with ``--deterministic both`` each specdec method runs in both modes, each mode's
variants checked against its own plain decoding. Aggregation is in :mod:`specdec.bench.summary`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from specdec.bench.measurement import Measurement
from specdec.bench.methods import REFERENCE, MethodSpec, Runner, reference_label
from specdec.bench.summary import OVERALL, Calibration, SummaryRow, summarize
from specdec.errors import SpecDecError
from specdec.greedy_check import GreedyVerdict, check_greedy, first_difference

if TYPE_CHECKING:
    from specdec.bench.workloads import Question


@dataclass
class BenchSettings:
    """How every method runs: tokens per turn, temperature, seeds, repeats, warm-up calls, context
    window, and the batch sizes swept (prompts per generate call)."""

    max_tokens: int
    temperature: float = 0.0
    seeds: tuple[int, ...] = (0,)
    repeats: int = 1
    warmup: int = 1
    context_window: int | None = None
    batch_sizes: tuple[int, ...] = (1,)

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
        if not self.batch_sizes or any(not isinstance(b, int) or b < 1 for b in self.batch_sizes):
            raise SpecDecError(f"batch sizes must be integers >= 1, got {list(self.batch_sizes)}")
        self.seeds = tuple(self.seeds)
        self.batch_sizes = tuple(dict.fromkeys(self.batch_sizes))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class BenchResult:
    """Everything a run produced: settings, method descriptions, raw measurements, aggregates, the
    calibration they used and a free-form description of the run (``info``)."""

    settings: BenchSettings
    methods: list[dict[str, Any]]
    measurements: list[Measurement]
    summary: list[SummaryRow]
    skipped: list[dict[str, Any]] = field(default_factory=list)
    calibration: Calibration = field(default_factory=Calibration)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def mismatches(self) -> dict[str, int]:
        """Greedy mismatches per method label, all batch sizes together (only methods with at least one)."""
        counts: dict[str, int] = {}
        for r in self.summary:
            if r.category == OVERALL and r.mismatches:
                counts[r.label] = counts.get(r.label, 0) + r.mismatches
        return counts

    @property
    def ties(self) -> dict[str, int]:
        """Greedy differences judged rounding ties, per method label (only methods with at least one)."""
        counts: dict[str, int] = {}
        for r in self.summary:
            if r.category == OVERALL and r.ties:
                counts[r.label] = counts.get(r.label, 0) + r.ties
        return counts

    @property
    def checked(self) -> dict[str, int]:
        """Greedy-checked generations per method label, all batch sizes together."""
        counts: dict[str, int] = {}
        for r in self.summary:
            if r.category == OVERALL:
                counts[r.label] = counts.get(r.label, 0) + r.checked
        return counts


class PromptSource(Protocol):
    """What the harness needs from a prompt builder (see :class:`specdec.bench.workloads.PromptBuilder`)."""

    def build(self, turns: Sequence[str], answers: Sequence[str]) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


def _fits(prompt_ids: list[int], settings: BenchSettings) -> bool:
    return settings.context_window is None or len(prompt_ids) + settings.max_tokens <= settings.context_window


def _warm_up(
    runners: Sequence[Runner],
    questions: Sequence[Question],
    prompts: PromptSource,
    settings: BenchSettings,
    batch_size: int,
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
            runner.run([prompt_ids] * batch_size, settings.max_tokens, settings.temperature, settings.seeds[0])
        runner.forget()  # a cross-request cache must not have seen a measured question


def groups(questions: Sequence[Question], batch_size: int) -> list[list[Question]]:
    """The questions of each category, in order, cut into groups of ``batch_size`` (the last
    group of a category may be smaller); a group never mixes categories."""
    by_category: dict[str, list[Question]] = {}
    for question in questions:
        by_category.setdefault(question.category, []).append(question)
    return [
        members[i : i + batch_size] for members in by_category.values() for i in range(0, len(members), batch_size)
    ]


Judge = Callable[[Sequence[int], Sequence[int], Sequence[int]], GreedyVerdict]
"""``judge(prompt_ids, expected, actual)``: the verdict on a greedy output (see :func:`check_greedy`)."""


def _untied(prompt_ids: Sequence[int], expected: Sequence[int], actual: Sequence[int]) -> GreedyVerdict:
    """The judge without a target to ask: every difference is a mismatch."""
    position = first_difference(expected, actual)
    return GreedyVerdict("equal") if position is None else GreedyVerdict("mismatch", position)


def reference_judge(runners: Sequence[Runner]) -> Judge:
    """:func:`check_greedy` under the target of the first ``plain`` runner (when it exposes specdec's
    ``llm``); in deterministic mode every difference is a mismatch (outputs must be identical: no rounding
    ties)."""
    llm = next((getattr(r, "llm", None) for r in runners if r.spec.method == REFERENCE), None)
    if llm is None or getattr(llm, "deterministic", False):
        return _untied
    return lambda prompt_ids, expected, actual: check_greedy(llm.target, prompt_ids, expected, actual)


def _references(runners: Sequence[Runner]) -> dict[str, Runner]:
    """The ``plain`` runners by label: one per mode that a specdec method runs in (a transformers peer runs
    in the default mode, and is compared with deterministic plain decoding when that is the only one)."""
    plains = [r for r in runners if r.spec.method == REFERENCE]
    references = {r.spec.label: r for r in plains}
    modes = {r.spec.deterministic for r in runners if not r.spec.kind.peer}
    missing = [MethodSpec(REFERENCE, deterministic=d).label for d in sorted(modes)]
    missing = [label for label in missing if label not in references]
    if not plains or len(references) != len(plains) or missing:
        raise SpecDecError(f"the benchmark needs exactly one {REFERENCE!r} runner, the reference, in each mode "
                           "its specdec methods run in" + (f" (no {', '.join(missing)})" if missing else ""))
    return references


def _check_against_reference(unit: list[Measurement], judges: dict[str, Judge]) -> None:
    """Mark each measurement of a unit as matching the output of its reference (``judges``' keys: plain
    decoding in each mode) on the same question and turn, and judge each difference (rounding tie or
    mismatch) with its reference's judge."""
    outputs = {(m.method, m.question_id, m.turn): m.token_ids for m in unit if m.method in judges}
    for m in unit:
        reference = reference_label(m.deterministic, judges)
        expected = outputs.get((reference, m.question_id, m.turn))
        if m.method in judges or expected is None:
            continue
        m.matches_reference = m.token_ids == expected
        if not m.matches_reference:
            m.verdict = judges[reference](m.prompt_ids, expected, m.token_ids)
            m.first_mismatch = m.verdict.position


@dataclass
class _Unit:
    """A group of questions under one seed and repeat, at one batch size, run by every eligible runner."""

    group: list[Question]
    seed: int
    repeat: int
    batch_size: int


def _run_unit(
    runner: Runner,
    unit: _Unit,
    order: int,
    prompts: PromptSource,
    settings: BenchSettings,
    calls: Iterator[int],
    skipped: list[dict[str, Any]],
) -> list[Measurement]:
    """Generate every turn of the unit's questions, one batched call per turn, each answer becoming part
    of its question's next prompt. A turn whose prompt does not fit the context window is recorded in
    ``skipped`` and ends that question."""
    done: list[Measurement] = []
    answers: list[list[str]] = [[] for _ in unit.group]
    active = [i for i, _ in enumerate(unit.group)]
    for turn in itertools.count():
        batch: list[tuple[int, list[int]]] = []
        for i in active:
            question = unit.group[i]
            if turn >= len(question.turns):
                continue
            prompt_ids = prompts.build(question.turns[: turn + 1], answers[i])
            if _fits(prompt_ids, settings):
                batch.append((i, prompt_ids))
                continue
            skipped.append(
                {
                    "question_id": question.question_id,
                    "turn": turn,
                    "seed": unit.seed,
                    "repeat": unit.repeat,
                    "batch_size": unit.batch_size,
                    "method": runner.spec.label,
                    "prompt_tokens": len(prompt_ids),
                }
            )
        if not batch:
            return done
        active = [i for i, _ in batch]
        out = runner.run([ids for _, ids in batch], settings.max_tokens, settings.temperature, unit.seed)
        call = next(calls)
        for (i, prompt_ids), token_ids, metrics in zip(batch, out.token_ids, out.metrics, strict=True):
            question = unit.group[i]
            done.append(
                Measurement(
                    question_id=question.question_id,
                    category=question.category,
                    turn=turn,
                    seed=unit.seed,
                    repeat=unit.repeat,
                    method=runner.spec.label,
                    batch_size=unit.batch_size,
                    call=call,
                    call_size=len(batch),
                    order=order,
                    deterministic=runner.spec.deterministic,
                    prompt_tokens=len(prompt_ids),
                    token_ids=list(token_ids),
                    seconds=out.seconds,
                    metrics=metrics,
                    prompt_ids=list(prompt_ids),
                )
            )
            answers[i].append(prompts.decode(token_ids))
    return done


def run_benchmark(
    runners: Sequence[Runner],
    questions: Sequence[Question],
    prompts: PromptSource,
    settings: BenchSettings,
    calibration: Calibration | None = None,
    progress: bool = True,
    judge: Judge | None = None,
) -> BenchResult:
    """For each batch size, warm up, then run every unit with every eligible runner in rotating order.

    Exactly one runner must be ``plain`` in each mode its specdec runners run in (default, deterministic):
    it is the reference for the speedups and greedy checks of that mode's runners, and must take the
    largest batch size. ``calibration`` holds what was measured beside the runs (direct cost ratios,
    ideal ratios, the roofline's least step time; see :func:`specdec.bench.summary.summarize`). ``judge``
    classifies greedy differences (default: :func:`reference_judge` of each mode's reference).
    """
    from tqdm.auto import tqdm

    references = _references(runners)
    for reference in references.values():
        if reference.max_batch_size < max(settings.batch_sizes):
            raise SpecDecError(
                f"the {reference.spec.label!r} runner takes at most {reference.max_batch_size} prompts per call, "
                f"fewer than batch size {max(settings.batch_sizes)}"
            )
    if not questions:
        raise SpecDecError("the benchmark needs at least one question")

    plan = []
    for batch_size in settings.batch_sizes:
        eligible = [r for r in runners if r.max_batch_size >= batch_size]
        units = [  # pass by pass: every group under one repeat and seed, then the next pass
            _Unit(group, seed, repeat, batch_size)
            for repeat in range(settings.repeats)
            for seed in settings.seeds
            for group in groups(questions, batch_size)
        ]
        plan.append((batch_size, eligible, units))

    judges = {label: judge or reference_judge([reference]) for label, reference in references.items()}
    measurements: list[Measurement] = []
    skipped: list[dict[str, Any]] = []
    calls = itertools.count()
    total = sum(len(eligible) * len(units) for _, eligible, units in plan)
    with tqdm(total=total, desc="bench", unit="run", disable=not progress) as bar:
        for batch_size, eligible, units in plan:
            _warm_up(eligible, questions, prompts, settings, batch_size)
            for index, unit in enumerate(units):
                if index and (unit.repeat, unit.seed) != (units[index - 1].repeat, units[index - 1].seed):
                    for runner in eligible:  # a new pass: a cross-request cache starts as it did in the first
                        runner.forget()
                shift = index % len(eligible)
                done: list[Measurement] = []
                for order, runner in enumerate([*eligible[shift:], *eligible[:shift]]):
                    done += _run_unit(runner, unit, order, prompts, settings, calls, skipped)
                    bar.update(1)
                if settings.greedy:
                    _check_against_reference(done, judges)
                measurements.extend(done)
    calibration = calibration or Calibration()
    summary = summarize(measurements, [r.spec for r in runners], settings.greedy, calibration)
    return BenchResult(settings, [r.describe() for r in runners], measurements, summary, skipped, calibration)
