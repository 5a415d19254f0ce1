"""Continuous batching: admits waiting sequences into free slots, feeds their prompts, steps the
running ones, finishes and aborts them.

Sequences join and leave between steps. When every slot is taken, new sequences wait in a
queue in arrival order and are admitted as slots free up (the lowest free slot first, which
keeps the running slots packed) and as the KV pools' free blocks allow. When a step would need
more blocks than are free, the least advanced sequence (fewest tokens generated, the latest
admitted among equals) is preempted: its slot and blocks are freed and it goes back to the
front of the queue, to be recomputed from its tokens when it is admitted again.

Chunked prefill (``max_num_batched_tokens`` set, as vLLM's V1 scheduler does by default): an
admitted sequence's prompt is fed over as many steps as its length needs, beside the decoding
step of the sequences already running, so that a long prompt does not stall them. Each step
gives the decoding rows their tokens first (one per row plus the drafts the previous step fed,
the estimate of this step's); what is left of the token budget goes to the prompts being fed,
oldest first, at least :data:`MIN_PREFILL_CHUNK` tokens per step so that a prompt is never starved
by a saturated batch. In a server at the CPU's default budget the prompts' share is also paced by measured
time, so that the prompt tokens add at most half of plain decoding's step at the running rows
(:mod:`specdec.prefill_pacer`), whatever the rows draft. Where the
backend fuses them (``fuses_prefill``: the fast backend on a CPU) the chunks are fed in the decoding step's
own forward (:meth:`~specdec.engine.Engine.step_feeding`), and a sequence whose prompt is then cached (but
its pending token) joins the next step; else they are fed in forwards of their own first, and it joins the
decoding step of the same step. Without a budget every admitted prompt is fed whole at admission.
Chunking changes only when the prompt's tokens are fed: the cache, the drafter's state and so
every output are those of a prompt fed at once (tested). The engine is told the step's prompt tokens and those
that wait past the next step, which auto k weighs (:mod:`specdec.k_choice`: no drafts while such a queue waits).
"""

from __future__ import annotations

import time
from collections import deque

import torch

from specdec.engine import Engine, StepOutput
from specdec.errors import SpecDecError
from specdec.prefill_pacer import SHARE, PrefillPacer, check_prefill_share
from specdec.sequence import Sequence

MIN_PREFILL_CHUNK = 32
"""Prompt tokens fed per step at least, whatever the decoding rows leave of the budget."""


DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cuda": 2048, "cpu": 128}
"""The token budget of a step by device type (vLLM's V1 online-serving default on a GPU, where a forward
of a few thousand tokens costs little more than a decoding step; on a CPU a forward's cost grows with
every token, and 128-token chunks are also the cheaper prefill per token: 16 prompts of the ``1b`` shape
took 11.1 s fed at once, 4-5 s in 128-token chunks). In a server the CPU's budget is also paced by
measured time (:mod:`specdec.prefill_pacer`)."""


def paces_prefill(enabled: bool, value: object, device: torch.device, serving: bool) -> bool:
    """Whether the step's prompt tokens are paced by measured time (:mod:`specdec.prefill_pacer`): in a
    server with chunked prefill at the default budget on a CPU (a budget given is a number of tokens, kept
    as given)."""
    return enabled and serving and value is None and device.type == "cpu"


def prefill_share_of(value: object, enabled: bool, budget: object, device: torch.device,
                     serving: bool) -> float | None:
    """The share of a decoding step a paced step's prompt tokens may add (:mod:`specdec.prefill_pacer`) under
    these settings (those of :func:`paces_prefill`), or None where nothing is paced; ``value``: the share asked
    for (None: the default), refused where nothing is paced."""
    paced = paces_prefill(enabled, budget, device, serving)
    if value is None:
        return SHARE if paced else None
    share = check_prefill_share(value)
    if not paced:
        why = ("chunked prefill is off" if not enabled else "max_num_batched_tokens is given" if budget is not None
               else "this is not a server (serving=False)" if not serving else f"the device is {device.type}")
        raise SpecDecError(f"prefill_share paces chunked prefill's default token budget in a server on a CPU; "
                           f"here nothing is paced ({why}): drop it")
    return share


def max_num_batched_tokens_of(enabled: bool, value: object, max_num_seqs: int, device: torch.device) -> int | None:
    """The step's token budget of the settings (None: chunked prefill off), checked: ``value`` if given,
    else the device's default (at least ``max_num_seqs``)."""
    if not enabled:
        if value is not None:
            raise SpecDecError("max_num_batched_tokens is the token budget of chunked prefill; it takes "
                               "enable_chunked_prefill (drop one of them)")
        return None
    if value is None:
        value = max(DEFAULT_MAX_NUM_BATCHED_TOKENS.get(device.type, DEFAULT_MAX_NUM_BATCHED_TOKENS["cuda"]),
                    max_num_seqs)
    return check_max_num_batched_tokens(value, max_num_seqs)


def check_max_num_batched_tokens(value: object, max_num_seqs: int) -> int | None:
    """``value`` once it is a valid token budget per step (None: no chunked prefill); like vLLM, a budget
    must cover one token of every sequence that may run (``max_num_seqs``)."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecDecError(f"max_num_batched_tokens must be an integer >= 1, got {value!r}")
    if value < max_num_seqs:
        raise SpecDecError(f"max_num_batched_tokens ({value}) is smaller than max_num_seqs ({max_num_seqs}): a step "
                           "must fit one token of every running sequence; raise it or lower max_num_seqs")
    return value


class Scheduler:
    """Owns the queue and the running batch of one :class:`Engine` (``num_slots`` slots);
    ``max_num_batched_tokens``: the token budget of a step with chunked prefill (None: prompts are fed
    whole at admission); ``prefill_share``: if not None, the prompts' part of it is also kept within that
    share of a decoding step's measured time (:mod:`specdec.prefill_pacer`)."""

    def __init__(self, engine: Engine, num_slots: int, max_num_batched_tokens: int | None = None,
                 prefill_share: float | None = None) -> None:
        self.engine = engine
        self.max_num_batched_tokens = check_max_num_batched_tokens(max_num_batched_tokens, num_slots)
        self.pacer = (PrefillPacer(prefill_share)
                      if prefill_share is not None and self.max_num_batched_tokens is not None else None)
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # admitted, prompt partly fed (chunked prefill), in arrival order
        self.running: list[Sequence] = []
        self._free = list(range(num_slots))
        self._last_drafted = 0  # drafts the last decoding step fed the target
        self._admitted = 0
        self._order: dict[str, int] = {}  # request id -> admission count, for preemption order
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def num_running(self) -> int:
        """Sequences holding a slot: decoding, or with their prompt being fed."""
        return len(self.running) + len(self.prefilling)

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
        for group in (self.prefilling, self.running):
            for seq in group:
                if seq.request_id == request_id:
                    group.remove(seq)
                    self._finish(seq)
                    return True
        return False

    def step(self) -> list[StepOutput]:
        """Admit what fits (slots and KV blocks), preempt what no longer fits, feed prompts (within the
        step's token budget when chunked), run one engine step over every running sequence, retire the
        finished ones; returns the step's output of each sequence that ran (none when idle)."""
        holding = [*self.running, *self.prefilling]
        admitted: list[Sequence] = []
        while self.waiting and self._free and not self.engine.blocks_short(holding, [*admitted, self.waiting[0]]):
            seq = self.waiting.popleft()
            self._free.sort()
            seq.slot = self._free.pop(0)
            self._admitted += 1
            self._order[seq.request_id] = self._admitted
            admitted.append(seq)
        if not holding and not admitted and self.waiting and self._free:
            raise SpecDecError(f"the KV cache cannot hold request {self.waiting[0].request_id!r} "
                               f"({len(self.waiting[0].token_ids)} tokens) even alone; raise --kv-cache-memory")
        self.prefilling.extend(admitted)
        self._preempt()
        prompts, chunks, tic, drafting = [], [], time.perf_counter(), self.engine.metrics.time_drafting
        streams = bool(self.running)  # streams waiting on this step: their latency is what the pacer keeps
        backlog = 0  # prompt tokens that wait past the next step (a queue; auto k drafts nothing while there is one)
        if self.prefilling:
            chunks = self._chunks()
            backlog = self._backlog(chunks) if chunks is not None else 0
            if chunks is not None and self.running and self.engine.target.fuses_prefill:
                prompts = self.prefilling  # fed in the decoding step's forward below
            else:
                self._join(self.engine.prefill(self.prefilling, chunks))
        if not self.running:
            return []
        if prompts:
            outputs, started = self.engine.step_feeding(self.running, prompts, chunks, prompt_backlog=backlog)
        else:
            outputs, started = self.engine.step(self.running, prompt_backlog=backlog), []
        self._last_drafted = sum(out.num_drafted for out in outputs)
        if self.pacer is not None and streams:
            self.pacer.observe(sum(chunks or ()), len(self.running) + self._last_drafted, time.perf_counter() - tic,
                               self.engine.metrics.time_drafting - drafting, self._last_drafted)
        for seq in [s for s in self.running if s.finished]:
            self.running.remove(seq)
            self._finish(seq)
        self._join(started)
        return outputs

    def _join(self, started: list[Sequence]) -> None:
        """Sequences whose context is now cached (but the pending token) move from ``prefilling`` to ``running``."""
        if started:
            ids = {id(s) for s in started}
            self.prefilling = [s for s in self.prefilling if id(s) not in ids]
            self.running.extend(started)
            self.running.sort(key=lambda s: s.slot)

    def _chunks(self) -> list[int] | None:
        """Context tokens each sequence in ``prefilling`` gets this step (None: all it has left)."""
        if self.max_num_batched_tokens is None:
            return None
        # The decoding rows come first, and their drafts count against a budget of tokens (vLLM's meaning of
        # the budget). Not where the pacer budgets time: there the prompts' share is of plain decoding's step at
        # the rows, which the drafts neither take from nor add to.
        drafts = self._last_drafted if self.running and self.pacer is None else 0
        decoding = len(self.running) + drafts
        budget = max(self.max_num_batched_tokens - decoding, min(MIN_PREFILL_CHUNK, self.max_num_batched_tokens))
        if self.pacer is not None:
            budget = self.pacer.budget(budget, running=bool(self.running))
        chunks = []
        for seq in self.prefilling:
            chunks.append(min(self._left(seq), budget))
            budget -= chunks[-1]
        return chunks

    def _left(self, seq: Sequence) -> int:
        """Context tokens a sequence in ``prefilling`` has left to feed (all but its pending token)."""
        return len(seq.token_ids) - 1 - (self.engine.cache.lengths[seq.slot] if self.engine.is_prefilling(seq) else 0)

    def _backlog(self, chunks: list[int]) -> int:
        """The prompt tokens of the sequences in ``prefilling`` that still wait after the next step, if it feeds as
        many as this step's ``chunks`` (about what it feeds: tokens are left only where this step spent its budget):
        a queue, not a prompt the next step finishes (:mod:`specdec.k_choice`). Sequences waiting for a slot or
        blocks are not counted: speculation frees those sooner."""
        left = sum(self._left(seq) - chunk for seq, chunk in zip(self.prefilling, chunks))
        return max(0, left - sum(chunks))

    def _preempt(self) -> None:
        """Preempt sequences holding a slot, least advanced first, until one more step of every one of them
        (and the rest of the prompts being fed) fits every pool."""
        while len(self.running) + len(self.prefilling) > 1 and self.engine.blocks_short(
                [*self.running, *self.prefilling]):
            victim = min([*self.running, *self.prefilling],
                         key=lambda s: (s.num_generated, -self._order.get(s.request_id, 0)))
            group = self.running if any(s is victim for s in self.running) else self.prefilling
            group[:] = [s for s in group if s is not victim]
            self._finish(victim)
            self.waiting.appendleft(victim)
            self.num_preemptions += 1

    def _finish(self, seq: Sequence) -> None:
        self.engine.release(seq)
        self._free.append(seq.slot)
        self._order.pop(seq.request_id, None)
        seq.slot = -1
