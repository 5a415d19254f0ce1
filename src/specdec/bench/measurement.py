"""One benchmarked request (:class:`Measurement`): what the harness records and the summary aggregates.

It sits below both :mod:`specdec.bench.harness` (which produces measurements) and
:mod:`specdec.bench.summary` (which reduces them to rows), so neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdec.greedy_check import GreedyVerdict
    from specdec.metrics import RequestMetrics


@dataclass
class Measurement:
    """One request: a turn of a question under one method, batch size, seed and repeat.

    ``call`` identifies the generate call the request was part of (``call_size`` requests);
    ``seconds`` is that call's wall-clock time, shared by all its requests. ``deterministic``: the method
    ran in deterministic mode (its label ends with ``det``).
    """

    question_id: str
    category: str
    turn: int
    seed: int
    repeat: int
    method: str
    batch_size: int
    call: int
    call_size: int
    order: int
    prompt_tokens: int
    token_ids: list[int]
    seconds: float
    metrics: RequestMetrics | None
    matches_reference: bool | None = None
    first_mismatch: int | None = None
    verdict: GreedyVerdict | None = None
    deterministic: bool = False
    prompt_ids: list[int] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "question_id": self.question_id,
            "category": self.category,
            "turn": self.turn,
            "seed": self.seed,
            "repeat": self.repeat,
            "method": self.method,
            "deterministic": self.deterministic,
            "batch_size": self.batch_size,
            "call": self.call,
            "call_size": self.call_size,
            "order": self.order,
            "prompt_tokens": self.prompt_tokens,
            "num_tokens": len(self.token_ids),
            "seconds": self.seconds,
            "tokens_per_second": len(self.token_ids) / self.seconds if self.seconds > 0 else None,
            "matches_reference": self.matches_reference,
            "first_mismatch": self.first_mismatch,
            "greedy_check": self.verdict.to_dict() if self.verdict is not None else None,
            "metrics": self.metrics.to_dict() if self.metrics is not None else None,
            "token_ids": self.token_ids,
        }
