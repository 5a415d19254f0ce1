"""Feeding contexts into the target's slots: whole or in chunks, apart or in a step's own forward.

A sequence's context (its prompt, and after a preemption its output so far) is fed to the target but
its last, *pending* token, which the first decoding step feeds. A sequence's first feed empties its slot
and shares the full blocks the prefix cache holds of its context; how far the context is cached is then its
slot's length. A sequence whose first block is that of another one being fed (``n > 1``, a shared system
prompt) waits until that one is done, so that it finds its blocks. Full blocks are registered in the prefix
cache as they are fed. Once the whole context is cached the drafter is started on it, with the target's
hidden states of every context position for a drafter that reads them (kept here while the context is fed
over several steps, and with their cache entries for the prefix cache: :class:`~specdec.models.prefix_cache.
BlockFeatures`), so a prompt fed in chunks starts the drafter exactly as one fed at once.

A feed is planned as rows ``(sequence, first context index, count)`` (:meth:`PromptFeed.plan`), fed either in
forwards of their own (:meth:`PromptFeed.feed_apart`) or as the last rows of a decoding step's forward
(:meth:`PromptFeed.with_chunks`, then :meth:`PromptFeed.keep`); :meth:`PromptFeed.done` then says which
sequences are fed and :meth:`PromptFeed.start_drafter` hands them to the drafter.
"""

from __future__ import annotations

import dataclasses

import torch

from specdec.drafters.base import Drafter
from specdec.logprobs import token_logprobs
from specdec.models.base import CausalLM, ForwardBatch, KVCache, prefill_batches, to_device
from specdec.models.prefix_cache import BlockFeatures
from specdec.sequence import Sequence

FeedRow = tuple[Sequence, int, int]
"""A row of a feed: ``(sequence, first context index, count)``."""
SCORED_TOKENS = 512
"""The most tokens of a row scoring its prompt (:func:`scores_prompt`) in one forward: its logits of every token,
``[count, V]``, are what it holds in memory (512 x a 128k vocabulary in float32: 256 MiB)."""


class PromptFeed:
    """The contexts being fed to ``target``'s ``cache``, and the drafter (if any) they start on; the target's
    hidden states of ``hidden_layers`` are kept for it (and, with ``features``, for the prefix cache)."""

    def __init__(self, target: CausalLM, cache: KVCache, drafter: Drafter | None, hidden_layers: tuple[int, ...],
                 features: BlockFeatures | None) -> None:
        self.target, self.cache, self.drafter = target, cache, drafter
        self.hidden_layers, self.features = hidden_layers, features
        # A prefill wants those states of every prompt token but no logits: ``[0, H]`` head rows skip the head.
        self._no_head = (torch.empty(0, target.config.hidden_size, dtype=target.dtype, device=target.device)
                         if hidden_layers and target.supports_layer_subsets else None)
        # request id -> the target's hidden states of the chunks fed so far ([n, layers, H] each; none kept
        # without a drafter that reads them), while a context is fed over several steps.
        self.prefilling: dict[str, list[torch.Tensor]] = {}

    def feed(self, seqs: list[Sequence], num_tokens: list[int] | None = None) -> list[Sequence]:
        """Feed row ``b`` of ``seqs`` its next ``num_tokens[b]`` context tokens (None: all it has left, and then
        the sequences that waited for a shared first block too) in forwards of their own; returns the sequences
        now fed, their drafter started."""
        budget = None if num_tokens is None else {id(s): n for s, n in zip(seqs, num_tokens)}
        done: list[Sequence] = []
        todo = seqs
        while True:
            active, rows = self.plan(todo, budget)
            self.feed_apart(rows)
            ready = self.done(active)
            self.start_drafter(ready)
            done += ready
            # not started yet (a started one is being fed or, once ready, done): waited for a shared first block
            finished = {id(s) for s in done}
            waiting = [s for s in todo if s.request_id not in self.prefilling and id(s) not in finished]
            if budget is not None or not waiting or not ready:
                return done
            todo = waiting  # fed whole: the sequences that waited for a shared first block go next

    def plan(self, seqs: list[Sequence], budget: dict[int, int] | None) -> tuple[list[Sequence], list[FeedRow]]:
        """The sequences of ``seqs`` being fed (new ones started: see :meth:`_start`) and the rows to feed now, each
        its next ``budget[id(seq)]`` context tokens (None: all it has left), never its pending token; rows with
        nothing to feed are left out."""
        active = self._start(seqs, self.cache.caches_prefixes)
        rows = []
        for s in active:
            start = self.cache.lengths[s.slot]
            left = len(s.token_ids) - 1 - start
            count = left if budget is None else min(budget[id(s)], left)
            if count > 0:
                rows.append((s, start, count))
        return active, rows

    def feed_apart(self, rows: list[FeedRow]) -> None:
        """Feed ``rows`` in forwards of their own (ragged, as few as
        :data:`~specdec.models.base.PREFILL_TOKEN_BUDGET` allows), keeping what the drafter will need. A row whose
        prompt logprobs are still wanted (:func:`scores_prompt`) is fed alone with the logits of every token."""
        scoring = [scores_prompt(row) for row in rows]
        for s, first, total in (row for row, scores in zip(rows, scoring) if scores):
            for start in range(first, first + total, SCORED_TOKENS):  # [count, V] logits at a time
                row = (s, start, min(SCORED_TOKENS, first + total - start))
                batch = ForwardBatch.from_rows([s.token_ids[start: start + row[2]]], [start], [s.slot],
                                               self.target.device)
                batch.hidden_layers = self.hidden_layers
                out = self.target.forward(batch, self.cache)
                self.keep([row], out.hidden)
                _score(row, out.logits)
        rows = [row for row, scores in zip(rows, scoring) if not scores]
        by_slot = {s.slot: (s, start, count) for s, start, count in rows}
        for batch in prefill_batches([s.token_ids[a: a + n] for s, a, n in rows], [s.slot for s, _, _ in rows],
                                     self.target.device, starts=[a for _, a, _ in rows]):
            if self.hidden_layers:
                batch.hidden_layers, batch.logits_rows, batch.output_head = self.hidden_layers, None, self._no_head
            out = self.target.forward(batch, self.cache)
            self.keep([by_slot[slot] for slot in batch.slots], out.hidden)

    def with_chunks(self, batch: ForwardBatch, rows: list[FeedRow]) -> ForwardBatch:
        """A decoding step's ``batch`` with the chunks ``rows`` as its last rows (:mod:`specdec.models.segments`):
        logits of the step's tokens only, hidden states (if any are wanted) of every token."""
        flat, positions, cu = [], [], list(batch.cu_seqlens)
        for s, start, count in rows:
            flat.extend(s.token_ids[start: start + count])
            positions.extend(range(start, start + count))
            cu.append(cu[-1] + count)
        host = to_device([flat, positions], self.target.device)
        return dataclasses.replace(
            batch, input_ids=torch.cat([batch.input_ids, host[0]]), positions=torch.cat([batch.positions, host[1]]),
            slots=[*batch.slots, *(s.slot for s, _, _ in rows)], cu_seqlens=cu,
            logits_rows=slice(0, batch.cu_seqlens[-1]), hidden_rows=slice(0, cu[-1]) if batch.hidden_layers else None,
            chunk_rows=len(rows))

    def keep(self, rows: list[FeedRow], hidden: torch.Tensor | None) -> None:
        """Keep the target's hidden states of fed ``rows`` (``[sum of counts, layers, H]``, rows in order) for the
        drafter, and with their cache entries for the prefix cache (none without a drafter that reads them)."""
        if not self.hidden_layers:
            return
        first = 0
        for s, _, count in rows:
            self.prefilling[s.request_id].append(hidden[first: first + count])
            first += count
        if self.features is not None:
            self.features.write([r for s, start, count in rows for r in self.cache.rows_of(s.slot, start, count)],
                                hidden)

    def done(self, active: list[Sequence]) -> list[Sequence]:
        """After feeding ``active``: register their full blocks in the prefix cache; returns those whose context is
        now cached but the pending token (to start the drafter on with :meth:`start_drafter`)."""
        for s in active:
            self.cache.commit_prefix(s.slot, s.token_ids)
        return [s for s in active if self.cache.lengths[s.slot] >= len(s.token_ids) - 1]

    def start_drafter(self, ready: list[Sequence]) -> None:
        """Hand sequences whose context is fed to the drafter (with their context's hidden states)."""
        if self.drafter is not None and ready:
            if self.hidden_layers:
                none = torch.empty(0, len(self.hidden_layers), 0, device=self.target.device)
                parts = [self.prefilling[s.request_id] for s in ready]
                self.drafter.observe_hidden(ready, [none if not p else p[0] if len(p) == 1 else torch.cat(p)
                                                    for p in parts])
            self.drafter.add(ready)
        for s in ready:
            del self.prefilling[s.request_id]

    def forget(self, seq: Sequence) -> bool:
        """Drop a sequence being fed (aborted or finished); whether it was being fed."""
        return self.prefilling.pop(seq.request_id, None) is not None

    def _start(self, seqs: list[Sequence], caches: bool) -> list[Sequence]:
        """The sequences of ``seqs`` being fed, after starting (empty slot, a prefix-cache lookup where the pool
        ``caches`` prefixes and the sequence does not want its prompt's logprobs) those that are new, but a new one
        whose first block is that of another one being fed."""
        size = self.cache.block_size
        firsts = {tuple(s.token_ids[:size]) for s in seqs if s.request_id in self.prefilling} if caches else set()
        for s in seqs:
            if s.request_id in self.prefilling:
                continue
            lookup = caches and s.params.prompt_logprobs is None
            first = tuple(s.token_ids[:size])
            if lookup and first in firsts:
                continue
            if lookup and len(s.token_ids) > size:
                firsts.add(first)
            self.cache.release(s.slot)
            cached = self.cache.match_prefix(s.slot, s.token_ids) if lookup else 0
            if not s.metrics.num_steps:  # its first admission (a preempted sequence's output is cached too)
                s.metrics.num_cached_tokens = cached
            self.prefilling[s.request_id] = [self.features.read(s.slot, cached)] if cached and self.features else []
        return [s for s in seqs if s.request_id in self.prefilling]


def scores_prompt(row: FeedRow) -> bool:
    """Whether feeding ``row`` computes prompt logprobs its sequence still wants (``params.prompt_logprobs``): the
    logits at context position ``i`` give those of prompt token ``i + 1``."""
    s, start, count = row
    return s.params.prompt_logprobs is not None and start + count > len(s.prompt_logprobs) and start < len(
        s.prompt_ids) - 1


def _score(row: FeedRow, logits: torch.Tensor) -> None:
    """Append the prompt logprobs that the fed ``row``'s logits ``[count, V]`` give (:func:`scores_prompt`)."""
    s, start, count = row
    first, end = len(s.prompt_logprobs), min(start + count, len(s.prompt_ids) - 1)  # positions first..end-1
    if end <= first:
        return
    if first < start:
        raise RuntimeError(f"prompt logprobs of request {s.request_id}: positions {first}..{start - 1} were not fed")
    picked = logits[first - start: end - start]
    chosen = to_device(s.prompt_ids[first + 1: end + 1], logits.device)
    s.prompt_logprobs.extend(token_logprobs(picked, chosen, [s.params.prompt_logprobs] * len(chosen)))
