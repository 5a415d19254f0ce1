"""Speculative decoding metrics per request and per step batch (DESIGN vocabulary: α, τ, drafts, accepted)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field


@dataclass
class DraftCounts:
    """Tokens emitted and drafts counted over a sequence's steps: one request's (:class:`RequestMetrics`), or an
    engine's over every row of every step (:class:`BatchMetrics`). ``num_drafts``: the steps that drafted;
    ``accepted_per_position``: drafts accepted at each draft position, as long as the longest draft."""

    num_generated_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def count_step(self, num_drafted: int, num_accepted: int, num_emitted: int) -> None:
        """Count one sequence's step that drafted ``num_drafted``, accepted ``num_accepted`` and emitted
        ``num_emitted``."""
        self.num_generated_tokens += num_emitted
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self.accepted_per_position.extend([0] * (num_drafted - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def take_back(self, dropped: int, num_accepted: int, kept_accepted: int) -> None:
        """Uncount what a sequence's last step counted past where the output ended (a stop string found in its
        text): ``dropped`` emitted tokens, and of its ``num_accepted`` accepted drafts all but the first
        ``kept_accepted``."""
        self.num_generated_tokens -= dropped
        self.num_accepted_tokens -= num_accepted - kept_accepted
        for i in range(kept_accepted, num_accepted):
            self.accepted_per_position[i] -= 1


@dataclass
class RequestMetrics(DraftCounts):
    """Counters and timers of one request (:class:`DraftCounts` too).

    A step is one target forward over ``[pending, d_1..d_k]``; it emits ``accepted + 1``
    tokens (fewer when a stop condition falls inside the accepted run). Times are seconds:
    ``time_prefill`` (prompt into the target's and the drafter's caches), ``time_drafting``
    (drafter ``propose``/``observe``), ``time_target`` (target forwards of the steps) and
    ``time_other`` (verification, cache rollback, stop handling, bookkeeping).
    ``drafter_choices``: with ``method="auto"``, how many steps each candidate drafted for the request
    (by label: its method, ``method#i`` for the ``i``-th candidate when a method is listed twice).
    ``inner_steps``, ``inner_draft_tokens``, ``inner_accepted_tokens``: with ``method="cascade"``, the inner
    stage: the middle model's forwards, the small model's draft tokens it verified and those it accepted
    (the outer stage, the middle model's tokens verified by the target, is ``num_draft_tokens`` and
    ``num_accepted_tokens``). ``k_choices``: with ``num_speculative_tokens="auto"``, the steps on which the
    policy chose each k for the request (``{k: steps}``, 0 = no drafts). ``time_grammar_compile``: seconds
    spent compiling the request's structured-output constraint (0.0 when it was cached or there is none).
    ``num_cached_tokens``: the prompt tokens the prefix cache held when the request was admitted (fed from the
    cache, not computed; vLLM's ``RequestOutput.num_cached_tokens``).
    """

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_steps: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    time_prefill: float = 0.0
    time_drafting: float = 0.0
    time_target: float = 0.0
    time_other: float = 0.0
    drafter_choices: dict[str, int] = field(default_factory=dict)
    inner_steps: int = 0
    inner_draft_tokens: int = 0
    inner_accepted_tokens: int = 0
    k_choices: dict[int, int] = field(default_factory=dict)
    time_grammar_compile: float = 0.0

    def record_step(self, num_drafted: int, num_accepted: int, num_emitted: int) -> None:
        """Count one step that drafted ``num_drafted``, accepted ``num_accepted`` and emitted ``num_emitted``."""
        self.num_steps += 1
        self.count_step(num_drafted, num_accepted, num_emitted)
        self.drafted_per_position.extend([0] * (num_drafted - len(self.drafted_per_position)))
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1

    @property
    def time_total(self) -> float:
        return self.time_prefill + self.time_drafting + self.time_target + self.time_other

    @property
    def mean_acceptance_length(self) -> float:
        """τ: tokens emitted per target step, recovered/bonus token included (plain decoding: 1.0)."""
        return self.num_generated_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """α: accepted draft tokens / drafted tokens (0.0 when nothing was drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """Fraction of drafts whose i-th token was accepted, among drafts that reached position i."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def inner_acceptance_rate(self) -> float:
        """α of a cascade's inner stage: small-model drafts accepted by the middle model / drafted (0.0 if none)."""
        return self.inner_accepted_tokens / self.inner_draft_tokens if self.inner_draft_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens / wall time of the request, prefill included."""
        return self.num_generated_tokens / self.time_total if self.time_total > 0 else 0.0

    def merge(self, other: RequestMetrics) -> None:
        """Add another request's counters and timers into this one (for aggregates)."""
        for name in ("num_prompt_tokens", "num_cached_tokens", "num_generated_tokens", "num_steps", "num_drafts",
                     "num_draft_tokens", "num_accepted_tokens", "time_prefill", "time_drafting",
                     "time_target", "time_other", "inner_steps", "inner_draft_tokens", "inner_accepted_tokens",
                     "time_grammar_compile"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.accepted_per_position, other.accepted_per_position),
                             (self.drafted_per_position, other.drafted_per_position)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, value in enumerate(theirs):
                mine[i] += value
        for label, count in other.drafter_choices.items():
            self.drafter_choices[label] = self.drafter_choices.get(label, 0) + count
        for k, count in other.k_choices.items():
            self.k_choices[k] = self.k_choices.get(k, 0) + count

    @classmethod
    def of_choices(cls, choices: list[RequestMetrics]) -> RequestMetrics:
        """The metrics of one prompt's ``n`` outputs: their counters and timers added up, the prompt counted once
        (as the first output fed it; the others found its blocks or fed it again)."""
        total = cls()
        for choice in choices:
            total.merge(choice)
        total.num_prompt_tokens, total.num_cached_tokens = choices[0].num_prompt_tokens, choices[0].num_cached_tokens
        return total

    def to_dict(self) -> dict:
        """Counters, timers and derived rates as a JSON-ready dict."""
        data = asdict(self)
        data.update(
            time_total=self.time_total,
            mean_acceptance_length=self.mean_acceptance_length,
            acceptance_rate=self.acceptance_rate,
            acceptance_rate_per_position=self.acceptance_rate_per_position,
            inner_acceptance_rate=self.inner_acceptance_rate,
            tokens_per_second=self.tokens_per_second,
        )
        return data


@dataclass
class BatchMetrics(DraftCounts):
    """Counters and timers aggregated over engine steps (all requests together; :class:`DraftCounts` over every
    row of every step).

    ``num_rows`` sums the batch size of every step (``mean_batch_size`` = rows / steps);
    ``num_prompt_tokens``: prompt tokens submitted; ``num_drafts``: rows of steps that drafted (a sequence's
    step with drafts counts once);
    times are seconds per stage, summed over steps (CUDA events on a GPU, so each stage's
    asynchronous work is charged to that stage). ``drafter_choices``: with ``method="auto"``, the
    rows each candidate drafted for, summed over steps (see :class:`RequestMetrics`). ``inner_*``: a
    cascade's inner stage, summed over requests (see :class:`RequestMetrics`). ``k_choices``: with
    ``num_speculative_tokens="auto"``, the rows the policy gave each k, summed over steps;
    ``num_speculation_off_steps``: the steps on which it drafted for no row though some row could have
    (predicted speedup below 1, with the cost model calibrated by measured step times at that batch
    size (the guard of :mod:`specdec.adaptive`), and the cold-start and probe steps).
    ``k_choices_by_batch_size`` (``{rows: {k: rows given k}}``) and ``speculation_off_steps_by_batch_size``
    (``{rows: steps}``): the same by the number of rows of the step (also counted for a
    ``num_speculative_tokens_per_batch_size`` schedule), the decisions of a policy that knows the load.
    ``num_grammar_compiles`` and ``time_grammar_compile``: structured-output constraints compiled (cache
    misses) and the seconds it took.
    """

    num_steps: int = 0
    num_rows: int = 0
    num_prompt_tokens: int = 0
    time_prefill: float = 0.0
    time_drafting: float = 0.0
    time_target: float = 0.0
    time_other: float = 0.0
    drafter_choices: dict[str, int] = field(default_factory=dict)
    inner_steps: int = 0
    inner_draft_tokens: int = 0
    inner_accepted_tokens: int = 0
    k_choices: dict[int, int] = field(default_factory=dict)
    num_speculation_off_steps: int = 0
    k_choices_by_batch_size: dict[int, dict[int, int]] = field(default_factory=dict)
    speculation_off_steps_by_batch_size: dict[int, int] = field(default_factory=dict)
    num_grammar_compiles: int = 0
    time_grammar_compile: float = 0.0

    @property
    def mean_batch_size(self) -> float:
        return self.num_rows / self.num_steps if self.num_steps else 0.0

    def count_k_choices(self, ks: list[int], limits: list[int]) -> None:
        """Count one step's k per row (``ks``; rows that could draft, ``limits[b] > 0``, only), overall and
        by the step's number of rows, and the step as one with speculation off when no row drafts."""
        rows = len(ks)
        by_size = self.k_choices_by_batch_size.setdefault(rows, {})
        for limit, k in zip(limits, ks):
            if limit > 0:
                self.k_choices[k] = self.k_choices.get(k, 0) + 1
                by_size[k] = by_size.get(k, 0) + 1
        if any(limits) and not any(ks):
            self.num_speculation_off_steps += 1
            self.speculation_off_steps_by_batch_size[rows] = self.speculation_off_steps_by_batch_size.get(rows, 0) + 1

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per step over the whole batch."""
        return self.num_generated_tokens / self.num_steps if self.num_steps else 0.0

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(mean_batch_size=self.mean_batch_size, tokens_per_step=self.tokens_per_step)
        return data


class StageClock:
    """Times the consecutive stages of a step.

    On CPU each ``lap`` reads ``perf_counter``. On CUDA it records an event, and ``read``
    turns the events into seconds once the step's results have been read by the host (the
    events before that point are complete, so reading them adds no wait for GPU work).
    """

    def __init__(self, device) -> None:
        import torch

        self._torch = torch
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.names: list[str] = []

    def _now(self):
        if self.cuda:
            event = self._torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self.marks, self.names = [self._now()], []

    def lap(self, name: str) -> None:
        """End the stage ``name`` (it began at the previous lap or at ``start``)."""
        self.marks.append(self._now())
        self.names.append(name)

    def read(self) -> dict[str, float]:
        """Seconds per stage name (stages of one name add up)."""
        out: dict[str, float] = {}
        if self.cuda:
            self.marks[-1].synchronize()
        for name, a, b in zip(self.names, self.marks, self.marks[1:]):
            seconds = a.elapsed_time(b) / 1000 if self.cuda else b - a
            out[name] = out.get(name, 0.0) + seconds
        return out
