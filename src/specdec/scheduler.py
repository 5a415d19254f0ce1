"""Continuous batching: admits waiting sequences into free slots, steps the running ones,
finishes and aborts them.

Sequences join and leave between steps. When every slot is taken, new sequences wait in a
queue in arrival order and are admitted as slots free up (the lowest free slot first, which
keeps the running slots packed, so the pool is sliced rather than gathered).
"""

from __future__ import annotations

from collections import deque

from specdec.engine import Engine, StepOutput
from specdec.sequence import Sequence


class Scheduler:
    """Owns the queue and the running batch of one :class:`Engine` (``num_slots`` slots)."""

    def __init__(self, engine: Engine, num_slots: int) -> None:
        self.engine = engine
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free = list(range(num_slots))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; it is admitted at the next ``step`` with a free slot."""
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """Remove a waiting or running sequence and free its slot; returns whether it was found
        (an unknown or already finished id is a no-op)."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return True
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                self._finish(seq)
                return True
        return False

    def step(self) -> list[StepOutput]:
        """Admit what fits, run one engine step over every running sequence, retire the finished
        ones; returns the step's output of each sequence that ran (none when idle)."""
        admitted = []
        while self.waiting and self._free:
            seq = self.waiting.popleft()
            self._free.sort()
            seq.slot = self._free.pop(0)
            admitted.append(seq)
        if admitted:
            self.engine.prefill(admitted)
            self.running.extend(admitted)
            self.running.sort(key=lambda s: s.slot)
        if not self.running:
            return []
        outputs = self.engine.step(self.running)
        for seq in [s for s in self.running if s.finished]:
            self.running.remove(seq)
            self._finish(seq)
        return outputs

    def _finish(self, seq: Sequence) -> None:
        self.engine.release(seq)
        self._free.append(seq.slot)
        seq.slot = -1
