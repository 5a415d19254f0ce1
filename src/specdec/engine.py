"""One batched speculative step as numbered stages.

Cache invariant (chain): a sequence's slot holds every committed token except the last, the
*pending* token. A step feeds each row ``[pending, d_1..d_n]`` at positions ``L..L+n``; with
``a`` drafts accepted the slot is rolled back to ``L+1+a`` and the recovered or bonus token
becomes the new pending token. Plain decoding is the same step with no drafter (n = 0).

Trees (``DraftBatch.parents``, the form of :mod:`specdec.tree`): a row feeds ``[pending,
nodes]`` at cache indices ``L..L+n`` and positions ``L + depth`` with the tree's ancestor mask;
after verification the accepted path's entries are moved to ``L+1..L+a``
(``cache.compact``) and the slot is rolled back to ``L+1+a`` as for a chain.

The step reads the device once: the verified tokens and accepted counts of every row, as one
tensor. Everything before that (drafting, the target forward, sampling, verification) is
queued on the device without waiting for it.

Rows under a constraint (``Sequence.grammar``; :mod:`specdec.structured.state` says why this is exact):
stage 1 drafts with masked logits and reads the drafts once to check them against the grammar, cut each
chain at its first invalid token and build every verified position's mask; stage 3 masks the target's
logits with them; stage 4 advances each grammar over the committed tokens only (a grammar the engine fails on
there ends its row with finish reason ``"error"`` and the error, not the step). A step with no constrained row
does none of this.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from specdec.adaptive import AdaptiveK
from specdec.argmax import argmax
from specdec.drafters.base import DraftBatch, Drafter
from specdec.k_schedule import FixedK, ScheduledK
from specdec.logprobs import TokenLogprobs, token_logprobs
from specdec.metrics import BatchMetrics, RequestMetrics, StageClock
from specdec.min_tokens import ban_early_stops, below_floor
from specdec.models.base import CausalLM, ForwardBatch, KVCache, to_device
from specdec.models.cuda_graphs import one_time_setups
from specdec.models.prefix_cache import BlockFeatures
from specdec.penalties import DraftAdjuster, adjust, adjusted_rows
from specdec.prompt_feed import PromptFeed, scores_prompt
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence
from specdec.step_cost import StepCost, tokens_fed
from specdec.structured.state import GrammarEngineError, GrammarState, apply_bitmask, step_masks
from specdec.tree import ancestor_mask, compaction_moves, depths
from specdec.verify import greedy_accepted, verify_sampled, verify_tree_greedy


@dataclass
class StepOutput:
    """What one step committed for one sequence: ``token_ids`` (stops and ``max_tokens``
    already applied), how many tokens were drafted and how many of ``token_ids`` are accepted drafts (verification
    may have accepted more, past where the output ended), and ``finish_reason``
    (None, "stop", "length", or "error" with ``error``: the row's grammar failed, see below); ``logprobs``: one
    per token of ``token_ids`` when the sequence's ``params.logprobs`` is set (see :mod:`specdec.logprobs`), else
    None."""

    request_id: str
    token_ids: list[int]
    num_drafted: int
    num_accepted: int
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None
    error: GrammarEngineError | None = None


class Engine:
    """Runs batched steps of a target model over its KV pool with an optional drafter.

    ``num_speculative_tokens`` is k, the most drafts a row proposes per step (0 without a
    drafter); ``policy`` picks each row's k within it every step (default: always k; see
    :mod:`specdec.adaptive`). The engine owns the target's pool (``num_blocks`` blocks, None: every slot
    can be full; prefix caching with ``prefix_caching``); slots are assigned by the scheduler.
    ``deterministic``: sampled rows draw noise keyed by seed and token index (:mod:`specdec.keyed_noise`), so a
    seeded request's tokens do not depend on what was drafted.
    """

    def __init__(
        self, target: CausalLM, drafter: Drafter | None, num_speculative_tokens: int, num_slots: int,
        max_model_len: int, policy: FixedK | AdaptiveK | ScheduledK | None = None, num_blocks: int | None = None,
        prefix_caching: bool = False, deterministic: bool = False,
    ) -> None:
        self.target = target
        self.deterministic = deterministic  # sampled rows draw keyed noise (:mod:`specdec.keyed_noise`)
        self.drafter = drafter
        self.k = num_speculative_tokens if drafter is not None else 0
        self.policy = policy if policy is not None and drafter is not None else FixedK(self.k)
        self.cache: KVCache = target.new_cache(num_slots, max_model_len, num_blocks, prefix_caching)
        self.metrics = BatchMetrics()
        self.policy.bind_metrics(self.metrics)
        if drafter is not None:
            drafter.bind_target_cache(self.cache)
            drafter.bind_metrics(self.metrics)
        # The target's hidden states the drafter reads (returned by every forward, handed over verified).
        self.hidden_layers = drafter.hidden_layers if drafter is not None else ()
        # With prefix caching, those states of every cached entry, so that a hit hands them over too.
        self.features = BlockFeatures(self.cache) if self.hidden_layers and self.cache.caches_prefixes else None
        self.feed = PromptFeed(target, self.cache, drafter, self.hidden_layers, self.features)
        self._clock = StageClock(target.device)

    # ------------------------------------------------------------------ lifecycle
    def prefill(self, seqs: list[Sequence], num_tokens: list[int] | None = None) -> list[Sequence]:
        """Feed contexts into the target's slots (``slot`` set): row ``b`` its next ``num_tokens[b]``
        context tokens (default: all it has left), never its pending (last) token, in ragged forwards,
        as few as :data:`~specdec.models.base.PREFILL_TOKEN_BUDGET` allows. The context is the prompt, and
        after a preemption the output so far too.

        Prefix-cache sharing, sequences waiting for a shared first block and the drafter's start are
        :mod:`specdec.prompt_feed`'s. Returns the sequences whose context is now cached but the pending token
        (their drafter started); a context fed in chunks over several steps starts the drafter exactly as one fed
        at once."""
        clock = self._clock
        clock.start()
        done = self.feed.feed(seqs, num_tokens)
        clock.lap("prefill")
        seconds = clock.read()["prefill"]
        self.metrics.time_prefill += seconds
        for s in seqs:
            s.metrics.time_prefill += seconds
        return done

    def is_prefilling(self, seq: Sequence) -> bool:
        """Whether part of the sequence's prompt was fed and the rest is still to come."""
        return seq.request_id in self.feed.prefilling

    def kv_pools(self) -> list[KVCache]:
        """The target's pool and the drafter's own, slot for slot."""
        return [self.cache, *(self.drafter.kv_pools() if self.drafter is not None else [])]

    def blocks_short(self, seqs: list[Sequence], new: list[Sequence] = ()) -> bool:
        """Whether some pool lacks the blocks for one more step of running ``seqs`` (each may grow by its
        pending token and ``k`` drafts) and for prefilling ``new`` (waiting sequences, counted without any
        prefix-cache hit)."""
        for pool in self.kv_pools():
            need = sum(pool.blocks_needed(s.slot, min(len(s.token_ids) + self.k, pool.capacity)) for s in seqs)
            need += sum(pool.blocks_for(min(len(s.token_ids) + self.k, pool.capacity)) for s in new)
            if need > pool.num_free_blocks:
                return True
        return False

    def release(self, seq: Sequence) -> None:
        """Free a finished or aborted sequence's slot and drafter state (a sequence aborted while its
        prompt was being fed has no drafter state yet)."""
        self.cache.release(seq.slot)
        self.policy.release(seq)
        if not self.feed.forget(seq) and self.drafter is not None:
            self.drafter.release(seq)

    # ------------------------------------------------------------------ the step
    def step(self, seqs: list[Sequence], prompt_backlog: int = 0) -> list[StepOutput]:
        """One batched step over ``seqs`` (running, unfinished); returns one output per sequence.
        ``prompt_backlog``: prompt tokens of admitted sequences that wait past the next step, a queue (auto k
        drafts nothing while there is one: :mod:`specdec.k_choice`)."""
        return self.step_feeding(seqs, [], [], prompt_backlog)[0]

    def step_feeding(self, seqs: list[Sequence], prompts: list[Sequence], chunks: list[int], prompt_backlog: int = 0
                     ) -> tuple[list[StepOutput], list[Sequence]]:
        """:meth:`step` over ``seqs`` while the next ``chunks[i]`` context tokens of each of ``prompts`` (sequences
        being fed, as in :meth:`prefill`) are fed: in the step's own forward where the backend ``fuses_prefill``
        and that forward is a chain over every layer (the prompt rows follow the step's rows, see
        :mod:`specdec.models.segments`), else in forwards of their own before it. Returns the step's outputs
        and the sequences whose context is now cached but the pending token (their drafter started): they join
        the next step. A fused forward's time is split between the step (its target time) and the prompts (their
        prefill time) by tokens fed in the metrics; the policy learns acceptance from such a step, and its
        forward's cost over all its tokens (not the cost of its shape)."""
        clock, device = self._clock, self.target.device
        clock.start()
        setups = one_time_setups()
        grammars = [s.grammar for s in seqs]
        constrained = any(g is not None for g in grammars)
        adjusted = adjusted_rows(seqs)  # their drafts are drawn from adjusted logits, their target's logits adjusted
        members = dict(zip(adjusted, range(len(adjusted))))
        adjuster = DraftAdjuster([seqs[b] for b in adjusted]) if adjusted and self.drafter is not None else None
        sampling = SamplingBatch([s.params for s in seqs], [s.generator for s in seqs], device,
                                 grammars if constrained else None,
                                 [len(s.token_ids) for s in seqs] if self.deterministic else None,
                                 adjuster, [members.get(b) for b in range(len(seqs))])

        # 1. Propose: the policy's k per row, at most k, never more than the tokens it may still
        #    emit minus the one the target always adds.
        #    A probe while speculation is off drafts the rows whose drafters have the least to catch up.
        #    The prompt tokens fed besides are priced with the drafts; while a queue waits past the next step,
        #    auto k drafts nothing, and a probe while off waits for a step that feeds no prompt.
        #    The drafter first catches up on what it has not absorbed (timed apart: a switching cost).
        ks = self.policy.choose(seqs, [max(0, min(self.k, s.remaining - 1)) for s in seqs],
                                self.drafter.backlog if self.drafter is not None else None, sum(chunks), prompt_backlog)
        draft = None
        if self.drafter is not None and any(ks):
            self.drafter.catch_up(seqs, ks)
            clock.lap("catch_up")
            draft = self.drafter.propose(seqs, ks, sampling)
        if constrained:  # drafts cut at their first invalid token; the masks of every verified position
            draft, masks = self._constrain(grammars, draft, sampling)
        width = draft.tokens.shape[1] if draft is not None else 0
        num_drafted = draft.num_draft if draft is not None else [0] * len(seqs)
        clock.lap("drafting")

        # 2. Target forward over every row's [pending, d_1..d_n] at positions L..L+n, and the prompt chunks.
        active, feed = self.feed.plan(prompts, {id(s): n for s, n in zip(prompts, chunks)}) if prompts else ([], [])
        fused = bool(feed) and self.target.fuses_prefill and (draft is None or (draft.parents is None
                                                                               and draft.hidden is None)) and not any(
            scores_prompt(row) for row in feed)  # a row scoring its prompt is fed alone, with every logit
        if feed and not fused:
            self.feed.feed_apart(feed)
            clock.lap("prefill")
        if width == 0:
            batch = ForwardBatch.from_rows([s.token_ids[-1:] for s in seqs], [len(s.token_ids) - 1 for s in seqs],
                                           [s.slot for s in seqs], device)
        else:
            batch, grid = self._verify_batch(seqs, draft)
        batch.hidden_layers = self.hidden_layers
        forward = self.target.forward(self.feed.with_chunks(batch, feed) if fused else batch, self.cache)
        if fused and self.hidden_layers:
            self.feed.keep(feed, forward.hidden[batch.cu_seqlens[-1]:])
        logits = forward.logits
        if constrained and width == 0:
            logits = apply_bitmask(logits, masks[:, 0])
        clock.lap("target")

        # 3. Verify: greedy argmax matching, or exact rejection sampling, per row, in one call. With
        #    no drafts at all this is plain sampling from the target (what verification reduces to).
        #    Rows below their min_tokens decide from logits without their stop tokens (:mod:`specdec.min_tokens`),
        #    rows with penalties or biases from adjusted logits at every column (:mod:`specdec.penalties`).
        verified = logits  # the logits each emitted token was decided by: [B, V], or [B, K+1, V] below
        early = below_floor(seqs)
        if width == 0:  # logits are [B, V], one row per sequence
            if early:
                logits = ban_early_stops(logits, seqs)
            if adjusted:
                logits = adjust(logits, seqs, adjusted)
            token = argmax(logits) if sampling.all_greedy else sampling.sample(sampling.probs(logits))
            result = [[t, 0] for t in token.tolist()]  # the step's one host sync
        else:
            target_logits = logits.view(len(seqs), width + 1, -1) if grid is None else logits[grid]  # [B, K+1, V]
            if constrained:
                target_logits = apply_bitmask(target_logits, masks)
            verified = target_logits
            ancestors = (None if draft.parents is None or not (early or adjusted)
                         else ancestor_mask(draft.parents, to_device(draft.num_draft, device)))
            if early:
                target_logits = ban_early_stops(target_logits, seqs, None if ancestors is None else depths(ancestors))
            if adjusted:
                target_logits = adjust(target_logits, seqs, adjusted, draft.tokens, draft.num_draft, ancestors)
            if sampling.all_greedy and draft.parents is None:
                # Greedy chains are matched on the host: the step's one host sync reads the target's
                # argmax and the drafts, [B, 2K+1], and each row keeps its matching prefix.
                rows = torch.cat([argmax(target_logits), draft.tokens], dim=1).tolist()
                result = [row[: width + 1] + [greedy_accepted(row, row[width + 1 :], n)]
                          for row, n in zip(rows, draft.num_draft)]
                node_argmax = [row[: width + 1] for row in rows] if self.drafter.wants_node_argmax else []
            else:
                output, num_accepted, path = self._verify(draft, target_logits, sampling)
                # The step's one host sync: the target's argmax after every fed token (for a drafter that
                # reads it), every row's emitted tokens, accepted node indices (trees), count.
                extra = [argmax(target_logits)] if self.drafter.wants_node_argmax else []
                read = torch.cat([*extra, output, *([] if path is None else [path]), num_accepted[:, None]],
                                 dim=1).tolist()
                cut = (width + 1) * len(extra)
                node_argmax, result = [row[:cut] for row in read], [row[cut:] for row in read]
        if draft is not None and draft.parents is not None:  # accepted node indices per row
            paths = [row[width + 1 : width + 1 + row[-1]] for row in result]
        else:  # a chain's accepted nodes are its first drafts
            paths = [list(range(row[-1])) for row in result]
        if draft is not None and draft.parents is not None:  # the accepted path's cache entries to L+1..L+a
            starts = [len(s.token_ids) - 1 for s in seqs]
            self.cache.compact(*compaction_moves([s.slot for s in seqs], starts, paths))
        clock.lap("other")

        # 4. Commit: emit accepted drafts plus the recovered/bonus token, stopping exactly at a stop
        #    token or the token budget; roll each slot back to L+1+a.
        outputs = []
        accepted = []
        pending_at = [len(s.token_ids) - 1 for s in seqs]  # each row's position L
        for s, row, drafted, start in zip(seqs, result, num_drafted, pending_at):
            n = row[-1]
            kept, error = s.commit(row[: n + 1]), None
            if s.grammar is not None:
                try:
                    s.grammar.commit(kept)
                except GrammarEngineError as exc:  # this row's constraint broke: it ends, the others go on
                    error, s.finish_reason = exc, "error"
            self.cache.set_length(s.slot, start + 1 + n)
            self.cache.commit_prefix(s.slot, s.token_ids)
            emitted = min(n, len(kept))  # accepted drafts before the output ended (a stop token, the budget)
            s.metrics.record_step(drafted, emitted, len(kept))
            accepted.append(n)
            outputs.append(StepOutput(s.request_id, kept, drafted, emitted, s.finish_reason, error=error))
        if any(s.params.logprobs is not None for s in seqs):
            self._logprobs(seqs, outputs, verified, paths)
        if self.hidden_layers:  # the states of each row's verified positions: the pending token, the accepted drafts
            cu = batch.cu_seqlens
            sizes = [len(path) + 1 for path in paths]
            verified_hidden = forward.hidden[[cu[b] + j for b, path in enumerate(paths)
                                              for j in (0, *(p + 1 for p in path))]]
        if self.features is not None:  # kept with their entries (finished rows too)
            self.features.write([r for s, start, n in zip(seqs, pending_at, sizes)
                                 for r in self.cache.rows_of(s.slot, start, n)], verified_hidden)
        clock.lap("other")

        # 5. Observe: the drafter rolls back its own state for the rows that go on.
        if self.drafter is not None:
            going_on = [(s, a) for s, a in zip(seqs, accepted) if not s.finished]
            if going_on and self.hidden_layers:  # the verified positions: the pending token and the accepted drafts
                self.drafter.observe_hidden([s for s, _ in going_on], [
                    h for h, s in zip(verified_hidden.split(sizes), seqs) if not s.finished])
            if going_on and width > 0 and self.drafter.wants_node_argmax:
                self.drafter.observe_node_argmax([s for s, _ in going_on],
                                                 [r for s, r in zip(seqs, node_argmax) if not s.finished])
            if going_on and draft is not None and draft.parents is not None:
                self.drafter.observe_paths([s for s, _ in going_on], [p for s, p in zip(seqs, paths) if not s.finished])
            if going_on:
                self.drafter.observe([s for s, _ in going_on], [a for _, a in going_on])
        clock.lap("drafting")

        # 6. Metrics and the policy's measurements; the outputs go to the scheduler.
        times = clock.read()
        catch_up = times.pop("catch_up", 0.0)  # drafting in the metrics; apart for the policy
        times["drafting"] = times.get("drafting", 0.0) + catch_up
        if fused:  # the prompt chunks' share of the forward, by tokens fed
            prompt = sum(n for _, _, n in feed)
            times["prefill"] = times["target"] * prompt / (prompt + batch.cu_seqlens[-1])
            times["target"] -= times["prefill"]
        if feed:
            self.metrics.time_prefill += times["prefill"]
            for s in prompts:
                s.metrics.time_prefill += times["prefill"]
        self._record(seqs, outputs, times)
        fed = tokens_fed(num_drafted, width, self.target.pads_rows)
        self.policy.observe(seqs, num_drafted, accepted, StepCost(
            fed, width, times["target"] + times.get("prefill", 0.0) + times["other"], times["drafting"],
            sum(n for _, _, n in feed), one_time_setups() != setups, catch_up, fused))
        started = self.feed.done(active)
        self.feed.start_drafter(started)
        return outputs, started

    def _logprobs(self, seqs: list[Sequence], outputs: list[StepOutput], verified: torch.Tensor,
                  paths: list[list[int]]) -> None:
        """Stage 4's logprobs of the rows that ask for them, from ``verified`` (``[B, V]`` or ``[B, K+1, V]``,
        masked under constraints): row ``b``'s emitted token ``i`` was decided at column 0 (``i = 0``) or at
        the column of its ``i``-th accepted node, ``paths[b][i - 1] + 1`` (a chain's nodes are its columns)."""
        columns = verified.shape[1] if verified.dim() == 3 else 1
        rows, chosen, num_top, owners = [], [], [], []
        for b, (s, out) in enumerate(zip(seqs, outputs)):
            if s.params.logprobs is None or not out.token_ids:
                continue
            cols = [0, *(p + 1 for p in paths[b])][: len(out.token_ids)]
            rows.extend(b * columns + c for c in cols)
            chosen.extend(out.token_ids)
            num_top.extend([s.params.logprobs] * len(cols))
            owners.append((out, len(cols)))
        if not rows:
            return
        device = verified.device
        flat = verified.reshape(-1, verified.shape[-1])[to_device(rows, device)]
        values = iter(token_logprobs(flat, to_device(chosen, device), num_top))
        for out, count in owners:
            out.logprobs = [next(values) for _ in range(count)]

    def _constrain(self, grammars: list[GrammarState | None], draft: DraftBatch | None, sampling: SamplingBatch
                   ) -> tuple[DraftBatch | None, torch.Tensor]:
        """Stage 1's end under constraints: the draft with each constrained chain cut at its first invalid
        token (see :func:`specdec.structured.state.step_masks`) and the masks ``[B, K+1, W]`` of every
        verified position (one host read of the drafts)."""
        for g in grammars:
            if g is not None:
                g.end_draft()
        rows, vocab = len(grammars), self.target.vocab_size
        if draft is None:
            return None, step_masks(grammars, [[]] * rows, [0] * rows, None, [False] * rows, vocab)[1]
        parents = None if draft.parents is None else draft.parents.tolist()
        sampled = [draft.probs is not None and not greedy for greedy in sampling.greedy_rows]
        num_draft, masks = step_masks(grammars, draft.tokens.tolist(), draft.num_draft, parents, sampled, vocab)
        if num_draft != draft.num_draft:
            draft = dataclasses.replace(draft, num_draft=num_draft)
        return draft, masks

    def _verify_batch(self, seqs: list[Sequence], draft: DraftBatch) -> tuple[ForwardBatch, torch.Tensor | None]:
        """The target's input for the step, and ``grid`` ``[B, K+1]``: the flat row of each
        (sequence, column) logit (columns past a row's drafts repeat its last token; never used),
        or None when every row drafted ``K`` tokens (the flat rows are then the grid in order)."""
        device = self.target.device
        width = draft.tokens.shape[1]
        cu, flat_index, grid, positions = [0], [], [], []
        for b, (s, n) in enumerate(zip(seqs, draft.num_draft)):
            base = cu[-1]
            flat_index.extend(range(b * (width + 1), b * (width + 1) + n + 1))
            grid.extend(base + min(i, n) for i in range(width + 1))
            start = len(s.token_ids) - 1
            positions.extend(range(start, start + n + 1))
            cu.append(base + n + 1)
        n = len(flat_index)
        host = to_device(flat_index + positions + grid + [s.token_ids[-1] for s in seqs], device)
        table = torch.cat([host[2 * n + len(grid) :, None], draft.tokens], dim=1)
        dense = n == len(grid)  # every row drafted ``width`` tokens: flat rows are the grid itself
        input_ids = table.reshape(-1) if dense else table.reshape(-1)[host[:n]]
        grid_t = None if dense else host[2 * n : 2 * n + len(grid)].view(len(seqs), width + 1)
        batch = ForwardBatch(input_ids, host[n : 2 * n], [s.slot for s in seqs], cu)
        if draft.parents is not None:  # each node sees its ancestors, at position L + depth
            mask = ancestor_mask(draft.parents, to_device(draft.num_draft, device))  # [B, K+1, K+1]
            flat = host[:n]
            batch.tree_mask = mask.reshape(-1, width + 1)[flat]
            batch.positions = batch.positions - flat % (width + 1) + depths(mask).reshape(-1)[flat]
        if draft.hidden is not None:  # the drafter already ran the first layers: resume after them
            batch.input_hidden = draft.hidden.reshape(-1, draft.hidden.shape[-1])[host[:n]]
            batch.layers = draft.remaining_layers
        return batch, grid_t

    @staticmethod
    def _verify(draft: DraftBatch, target_logits: torch.Tensor, sampling: SamplingBatch
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Exact verification of sampled chains, and of greedy or sampled trees (greedy chains are
        matched on the host in :meth:`step`): ``(output [B, K+1], num_accepted [B], path [B, K] or
        None)``; a chain's path (None) is its first ``num_accepted`` columns."""
        if sampling.all_greedy:  # a tree
            num_draft = to_device(draft.num_draft, target_logits.device)
            return verify_tree_greedy(draft.tokens, draft.parents, num_draft, target_logits)
        return verify_sampled(draft.tokens, draft.num_draft, draft.probs, draft.parents,
                              sampling.probs(target_logits), sampling)

    def trim(self, out: StepOutput, keep: int, metrics: RequestMetrics) -> StepOutput:
        """``out`` cut to its first ``keep`` tokens (a stop string in its text ended the output there), with the cut
        tokens and accepted drafts taken back from its request's ``metrics`` and from the engine's."""
        accepted, dropped = min(out.num_accepted, keep), len(out.token_ids) - keep
        for counts in (metrics, self.metrics):
            counts.take_back(dropped, out.num_accepted, accepted)
        logprobs = None if out.logprobs is None else out.logprobs[:keep]
        return dataclasses.replace(out, token_ids=out.token_ids[:keep], num_accepted=accepted, logprobs=logprobs)

    def _record(self, seqs: list[Sequence], outputs: list[StepOutput], times: dict[str, float]) -> None:
        m = self.metrics
        m.num_steps += 1
        m.num_rows += len(seqs)
        for out in outputs:
            m.count_step(out.num_drafted, out.num_accepted, len(out.token_ids))
        m.time_drafting += times["drafting"]
        m.time_target += times["target"]
        m.time_other += times["other"]
        for s in seqs:
            s.metrics.time_drafting += times["drafting"]
            s.metrics.time_target += times["target"]
            s.metrics.time_other += times["other"]
