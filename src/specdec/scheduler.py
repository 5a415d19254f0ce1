"""Continuous batching: admits waiting sequences into free slots, steps the running ones,
finishes and aborts them.

Sequences join and leave between steps. When every slot is taken, new sequences wait in a
queue in arrival order and are admitted as slots free up (the lowest free slot first, which
keeps the running slots packed) and as the KV pools' free blocks allow. When a step would need
more blocks than are free, the least advanced running sequence (fewest tokens generated, the
latest admitted among equals) is preempted: its slot and blocks are freed and it goes back to
the front of the queue, to be recomputed from its tokens when it is admitted again.
"""

from __future__ import annotations

from collections import deque

from specdec.engine import Engine, StepOutput
from specdec.errors import SpecDecError
from specdec.sequence import Sequence


class Scheduler:
    """Owns the queue and the running batch of one :class:`Engine` (``num_slots`` slots)."""

    def __init__(self, engine: Engine, num_slots: int) -> None:
        self.engine = engine
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free = list(range(num_slots))
        self._admitted = 0
        self._order: dict[str, int] = {}  # request id -> admission count, for preemption order
        self.num_preemptions = 0

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
        while self.waiting and self._free and not self.engine.blocks_short(self.running, [*admitted, self.waiting[0]]):
            seq = self.waiting.popleft()
            self._free.sort()
            seq.slot = self._free.pop(0)
            self._admitted += 1
            self._order[seq.request_id] = self._admitted
            admitted.append(seq)
        if not self.running and not admitted and self.waiting and self._free:
            raise SpecDecError(f"the KV cache cannot hold request {self.waiting[0].request_id!r} "
                               f"({len(self.waiting[0].token_ids)} tokens) even alone; raise --kv-cache-memory")
        if admitted:
            self.engine.prefill(admitted)
            self.running.extend(admitted)
            self.running.sort(key=lambda s: s.slot)
        if not self.running:
            return []
        self._preempt()
        outputs = self.engine.step(self.running)
        for seq in [s for s in self.running if s.finished]:
            self.running.remove(seq)
            self._finish(seq)
        return outputs

    def _preempt(self) -> None:
        """Preempt running sequences, least advanced first, until one more step fits every pool."""
        while len(self.running) > 1 and self.engine.blocks_short(self.running):
            victim = min(self.running, key=lambda s: (s.num_generated, -self._order.get(s.request_id, 0)))
            self.running.remove(victim)
            self._finish(victim)
            self.waiting.appendleft(victim)
            self.num_preemptions += 1

    def _finish(self, seq: Sequence) -> None:
        self.engine.release(seq)
        self._free.append(seq.slot)
        self._order.pop(seq.request_id, None)
        seq.slot = -1
