"""``num_speculative_tokens_per_batch_size``: a fixed schedule of k by the number of rows a step runs,
vLLM's way of turning speculation down as the batch grows, as an override of the cost model of
``num_speculative_tokens="auto"`` (:mod:`specdec.adaptive`).

A schedule maps batch sizes to k: ``{1: 4, 8: 2, 32: 0}`` (a dict, JSON's string keys accepted) or
``[[1, 4], [8, 2], [32, 0]]``. A step of ``B`` rows gives every row the k of the largest batch size at
or below ``B``: here 4 for 1 to 7 rows, 2 for 8 to 31, none (plain decoding) from 32. The first batch
size is 1 (every step has a k); each k is at most ``num_speculative_tokens``, the most a row drafts.
Any k fixed before a step is drafted keeps verification lossless. :class:`FixedK` is the schedule of one k, an
integer ``num_speculative_tokens``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from typing import Any

from specdec.errors import SpecDecError
from specdec.metrics import BatchMetrics
from specdec.sequence import Sequence
from specdec.step_cost import StepCost

NAME = "num_speculative_tokens_per_batch_size"


def parse_schedule(value: Any, max_k: int) -> tuple[tuple[int, int], ...]:
    """The ``(batch size, k)`` pairs of a schedule, in increasing batch size, checked (see the module
    docstring); ``max_k``: ``num_speculative_tokens``."""
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        pairs = [tuple(p) for p in value]
    else:
        raise SpecDecError(f"{NAME} must map batch sizes to k, as {{1: 4, 8: 2, 32: 0}} or [[1, 4], [8, 2], "
                           f"[32, 0]], got {value!r}")
    if not pairs:
        raise SpecDecError(f"{NAME} is empty; give at least {{1: k}}")
    schedule = []
    for size, k in pairs:
        if isinstance(size, str) and size.strip().isdigit():
            size = int(size)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise SpecDecError(f"{NAME}: a batch size must be an integer >= 1, got {size!r}")
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= max_k:
            raise SpecDecError(f"{NAME}: the k of batch size {size} must be an integer in 0..{max_k} "
                               f"(num_speculative_tokens), got {k!r}")
        schedule.append((size, k))
    schedule.sort()
    sizes = [size for size, _ in schedule]
    if len(set(sizes)) != len(sizes):
        raise SpecDecError(f"{NAME} gives batch size {next(s for s in sizes if sizes.count(s) > 1)} twice")
    if sizes[0] != 1:
        raise SpecDecError(f"{NAME} must start at batch size 1 (the k of the smallest batches), got {sizes[0]}")
    if not any(k for _, k in schedule):
        raise SpecDecError(f"{NAME} drafts at no batch size; for plain decoding give no speculative_config")
    return tuple(schedule)


class ScheduledK:
    """Every row of a step over ``B`` rows drafts the schedule's k for ``B`` (fewer when its budget says so);
    the choices are counted as auto k's are (``k_choices``, per batch size, steps with speculation off)."""

    def __init__(self, schedule: tuple[tuple[int, int], ...]) -> None:
        self.sizes = [size for size, _ in schedule]
        self.ks = [k for _, k in schedule]
        self.metrics: BatchMetrics | None = None

    def k_for(self, rows: int) -> int:
        """The schedule's k for a step of ``rows`` rows."""
        return self.ks[bisect_right(self.sizes, rows) - 1]

    def choose(self, seqs: list[Sequence], limits: list[int],
               backlog: Callable[[list[Sequence]], list[int]] | None = None, prompt_tokens: int = 0,
               prompt_backlog: int = 0) -> list[int]:
        """Tokens to draft per row; ``limits[b]`` is the most row ``b`` may draft this step (``backlog``, what
        each row's drafter would catch up on, ``prompt_tokens``, fed besides, and ``prompt_backlog``, waiting past
        the next step, do not change a schedule)."""
        k = self.k_for(len(seqs))
        ks = [min(k, limit) for limit in limits]
        for s, limit, chosen in zip(seqs, limits, ks):
            if limit > 0:
                s.metrics.k_choices[chosen] = s.metrics.k_choices.get(chosen, 0) + 1
        if self.metrics is not None:
            self.metrics.count_k_choices(ks, limits)
        return ks

    def observe(self, seqs: list[Sequence], num_drafted: list[int], num_accepted: list[int], step: StepCost) -> None:
        """A schedule learns nothing."""

    def release(self, seq: Sequence) -> None:
        """Nothing is kept per sequence."""

    def bind_metrics(self, metrics: BatchMetrics) -> None:
        self.metrics = metrics


class FixedK:
    """Every row drafts ``k`` tokens (fewer when its budget says so)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self, seqs: list[Sequence], limits: list[int],
               backlog: Callable[[list[Sequence]], list[int]] | None = None, prompt_tokens: int = 0,
               prompt_backlog: int = 0) -> list[int]:
        """Tokens to draft per row; ``limits[b]`` is the most row ``b`` may draft this step (``backlog``, what
        each row's drafter would catch up on, ``prompt_tokens``, fed besides, and ``prompt_backlog``, waiting past
        the next step, do not change a fixed k)."""
        return [min(self.k, limit) for limit in limits]

    def observe(self, seqs: list[Sequence], num_drafted: list[int], num_accepted: list[int], step: StepCost) -> None:
        """A fixed k learns nothing."""

    def release(self, seq: Sequence) -> None:
        """Nothing is kept per sequence."""

    def bind_metrics(self, metrics: BatchMetrics) -> None:
        """A fixed k has no choices to count."""
