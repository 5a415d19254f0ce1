"""Per-request speculative decoding metrics (DESIGN vocabulary: α, τ, drafts, accepted)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestMetrics:
    """Counters and timers of one request.

    A step is one target forward over ``[pending, d_1..d_k]``; it emits ``accepted + 1``
    tokens (fewer when a stop condition falls inside the accepted run). Times are seconds:
    ``time_prefill`` (prompt into the target's and the drafter's caches), ``time_drafting``
    (drafter ``propose``/``observe``), ``time_target`` (target forwards of the steps) and
    ``time_other`` (verification, cache rollback, stop handling, bookkeeping).
    """

    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    time_prefill: float = 0.0
    time_drafting: float = 0.0
    time_target: float = 0.0
    time_other: float = 0.0

    def record_step(self, num_drafted: int, num_accepted: int, num_emitted: int) -> None:
        """Count one step that drafted ``num_drafted``, accepted ``num_accepted`` and emitted ``num_emitted``."""
        self.num_steps += 1
        self.num_generated_tokens += num_emitted
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        grow = num_drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

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
    def tokens_per_second(self) -> float:
        """Generated tokens / wall time of the request, prefill included."""
        return self.num_generated_tokens / self.time_total if self.time_total > 0 else 0.0

    def merge(self, other: RequestMetrics) -> None:
        """Add another request's counters and timers into this one (for aggregates)."""
        for name in ("num_prompt_tokens", "num_generated_tokens", "num_steps", "num_drafts",
                     "num_draft_tokens", "num_accepted_tokens", "time_prefill", "time_drafting",
                     "time_target", "time_other"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.accepted_per_position, other.accepted_per_position),
                             (self.drafted_per_position, other.drafted_per_position)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, value in enumerate(theirs):
                mine[i] += value

    def to_dict(self) -> dict:
        """Counters, timers and derived rates as a JSON-ready dict."""
        data = asdict(self)
        data.update(
            time_total=self.time_total,
            mean_acceptance_length=self.mean_acceptance_length,
            acceptance_rate=self.acceptance_rate,
            acceptance_rate_per_position=self.acceptance_rate_per_position,
            tokens_per_second=self.tokens_per_second,
        )
        return data
