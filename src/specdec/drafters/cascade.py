"""``method="cascade"``: a small draft model speculates for a middle one, whose output drafts for the target.

``{"method": "cascade", "stages": [small, mid], "num_speculative_tokens": k}``, both stages ``draft_model``
configs with the target's tokenizer. Each step, for every row that drafts ``k_b`` tokens, the middle model
runs speculative decoding itself, in its own KV pool, with the small model as its drafter (``small``'s
``num_speculative_tokens`` drafts per middle forward, fewer when fewer tokens are still needed), until it
has produced exactly ``k_b`` tokens. Its inner verification is the engine's own: greedy argmax matching on
the host for an all-greedy batch (:func:`~specdec.verify.greedy_accepted`), else exact rejection sampling
(:func:`~specdec.verify.verify_sampled`) under each row's sampling parameters and generator. Those
``k_b`` tokens, with the middle model's sampling distribution at each of them, are the target's draft.

Why it is lossless: inner speculative sampling emits tokens distributed exactly as sampling from the middle
model one token at a time, so token ``i`` of the draft, given the ones before it, is distributed as the middle
model's ``q_i`` (the distribution recorded for it), which is exactly what the target's rejection sampling
needs of a draft; greedy rows get the middle model's greedy chain and a one-hot ``q``. The number of tokens
drafted is fixed before the step. After the target's verification both models roll their pools back to the
committed context, as a draft model does (:class:`~specdec.drafters.draft_model.DraftModelDrafter`).

The metrics count the inner stage (``inner_steps``, ``inner_draft_tokens``, ``inner_accepted_tokens`` of
:class:`~specdec.metrics.RequestMetrics` and :class:`~specdec.metrics.BatchMetrics`); the outer stage is the
ordinary ``num_draft_tokens`` and ``num_accepted_tokens``.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from specdec.adaptive import AUTO
from specdec.argmax import argmax
from specdec.drafters.base import (
    DraftBatch,
    Drafter,
    LoadOptions,
    SpeculativeConfig,
    draft_probs,
    register_drafter,
)
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.errors import SpecDecError
from specdec.metrics import BatchMetrics
from specdec.models.base import CausalLM, ForwardBatch, to_device
from specdec.models.loader import load_tokenizer
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence
from specdec.verify import greedy_accepted, verify_sampled

STAGE_METHOD = "draft_model"


@register_drafter
class CascadeDrafter(Drafter):
    """Two draft models in a chain: ``small`` drafts for ``mid`` (inner speculation, ``inner_k`` drafts per
    middle forward), whose exact samples and distributions are the target's draft (see the module docstring)."""

    method = "cascade"
    description = "cascade: a small draft model speculates for a middle one, whose exact samples draft k tokens"
    staged = True

    def __init__(self, small: DraftModelDrafter, mid: DraftModelDrafter, inner_k: int) -> None:
        self.small, self.mid, self.inner_k = small, mid, inner_k
        self.metrics: BatchMetrics | None = None

    @classmethod
    def check_config(cls, config: SpeculativeConfig) -> None:
        stages = config.stages
        if not stages or len(stages) != 2:
            raise SpecDecError("speculative method 'cascade' needs 'stages': two draft_model configs, the small "
                               f"draft first, then the middle one, got {stages!r}")
        if config.model is not None or config.draft_confidence_threshold is not None or config.candidates:
            raise SpecDecError("speculative method 'cascade' takes no 'model', 'draft_confidence_threshold' or "
                               "'candidates' of its own: give the models to its stages")
        for i, stage in enumerate(stages):
            if stage.method != STAGE_METHOD:
                raise SpecDecError(f"cascade stage {i} is {stage.method!r}: every stage is a {STAGE_METHOD} config")
            if stage.num_speculative_tokens == AUTO:
                raise SpecDecError(f"cascade stage {i}: a stage takes a fixed num_speculative_tokens (set 'auto' on "
                                   "the cascade config itself)")
        if stages[1].draft_confidence_threshold is not None:
            raise SpecDecError("cascade stage 1 (the middle model) takes no draft_confidence_threshold: its tokens "
                               "are exact samples, drafted k at a time")

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: CausalLM, options: LoadOptions) -> CascadeDrafter:
        small_config, mid_config = config.stages
        mid = DraftModelDrafter.from_config(mid_config, target, options)
        cls._check_same_tokenizer(mid, 1)
        mid_tokenizer = load_tokenizer(mid_config.model, required=False)
        if mid_tokenizer is not None:  # the small stage is checked against the model it drafts for
            options = dataclasses.replace(options, target_tokenizer=mid_tokenizer)
        small = DraftModelDrafter.from_config(small_config, mid.model, options)
        cls._check_same_tokenizer(small, 0)
        return cls(small, mid, small_config.max_k)

    @staticmethod
    def _check_same_tokenizer(stage: Drafter, index: int) -> None:
        if type(stage) is not DraftModelDrafter:  # a draft with another tokenizer is built as a subclass
            raise SpecDecError(f"cascade stage {index} ({stage.model.name!r}) has a tokenizer different from the "
                               "model it drafts for; the stages of a cascade must share the target's tokenizer")

    def bind_metrics(self, metrics: BatchMetrics) -> None:
        self.metrics = metrics

    def add(self, seqs: list[Sequence]) -> None:
        self.mid.add(seqs)
        self.small.add(seqs)

    def propose(self, seqs: list[Sequence], ks: list[int], sampling: SamplingBatch) -> DraftBatch:
        # Every middle-model token of a row stays within its pool: the context plus k - 1 drafts.
        ks = [max(0, min(k, self.mid.capacity + 1 - len(s.token_ids))) for s, k in zip(seqs, ks)]
        device = self.mid.model.device
        views = [copy.copy(s) for s in seqs]  # the context the middle model extends, one view per row
        for view, s in zip(views, seqs):
            view.token_ids = list(s.token_ids)
        made: list[list[int]] = [[] for _ in seqs]
        dists: list[list[torch.Tensor]] = [[] for _ in seqs]
        while True:
            active = [b for b, k in enumerate(ks) if len(made[b]) < k]
            if not active:
                break
            rows = sampling if len(active) == len(seqs) else sampling.select(active)
            rows = rows.shifted([len(made[b]) for b in active])  # keyed: the index each row drafts from now
            emitted, probs = self._inner_round([views[b] for b in active], [ks[b] - len(made[b]) for b in active],
                                               rows)
            for j, b in enumerate(active):
                made[b].extend(emitted[j])
                if probs is not None:
                    dists[b].append(probs[j, : len(emitted[j])])
                elif not sampling.all_greedy:  # a round of greedy rows only: their q is one-hot
                    one_hot = torch.nn.functional.one_hot(to_device(emitted[j], device), self.mid.model.vocab_size)
                    dists[b].append(one_hot)
        width = max(ks, default=0)
        tokens = to_device([row + [0] * (width - len(row)) for row in made], device).view(len(seqs), width)
        if sampling.all_greedy or width == 0:
            return DraftBatch(tokens, ks)
        reference = torch.empty(0, dtype=self.mid.model.dtype, device=device)
        q = draft_probs(reference, len(seqs), width, self.mid.model.vocab_size)
        for b, row in enumerate(dists):
            if row:
                q[b, : ks[b]] = torch.cat(row).to(q.dtype)
        return DraftBatch(tokens, ks, q)

    def _inner_round(self, views: list[Sequence], needed: list[int], rows: SamplingBatch
                     ) -> tuple[list[list[int]], torch.Tensor | None]:
        """One middle-model forward for each of ``views`` (rows still drafting; ``needed[j]`` tokens to go):
        the small model drafts up to ``min(inner_k, needed - 1)`` tokens, the middle model verifies them. Returns
        each row's emitted tokens (``accepted + 1``, at most ``needed``) and, unless every row is greedy, the
        middle model's sampling distributions ``[A, W+1, V]`` (column ``i`` is that of emitted token ``i``)."""
        inner_ks = [min(self.inner_k, n - 1) for n in needed]
        if any(inner_ks):
            # The small model drafts for the middle one, which is neither constrained nor adjusted (the middle
            # model's own drafts, unmasked, are checked and cut by the engine).
            draft = self.small.propose(views, inner_ks, rows.plain())
        else:
            draft = DraftBatch(torch.zeros(len(views), 0, dtype=torch.long, device=self.mid.model.device),
                               [0] * len(views))
        width = draft.tokens.shape[1]
        drafted = draft.tokens.tolist()
        cache = self.mid.cache
        cached = [cache.lengths[v.slot] for v in views]
        fed = [v.token_ids[c:] + d[:n] for v, c, d, n in zip(views, cached, drafted, draft.num_draft)]
        batch = ForwardBatch.from_rows(fed, cached, [v.slot for v in views], self.mid.model.device, logits="none")
        # The logits of each row's last n + 1 fed tokens, as a grid [A, W+1] (a short row repeats its last one).
        ends = batch.cu_seqlens[1:]
        grid = [end - 1 - max(0, n - i) for end, n in zip(ends, draft.num_draft) for i in range(width + 1)]
        batch.logits_rows = to_device(grid, self.mid.model.device)
        logits = self.mid.forward(batch).view(len(views), width + 1, -1)  # its draft vocabulary, if any
        if rows.all_greedy:
            result = [row + [greedy_accepted(row, d, n)]
                      for row, d, n in zip(argmax(logits).tolist(), drafted, draft.num_draft)]
            probs = None
        else:
            probs = rows.probs(logits)
            output, num_accepted, _ = verify_sampled(draft.tokens, draft.num_draft, draft.probs, None, probs, rows)
            result = torch.cat([output, num_accepted[:, None]], dim=1).tolist()
        emitted, accepted = [], []
        for view, row, n in zip(views, result, draft.num_draft):
            a = row[-1]
            # The slot keeps the context and the accepted drafts; the token emitted after them is pending.
            cache.set_length(view.slot, len(view.token_ids) + a)
            view.token_ids.extend(row[: a + 1])
            emitted.append(row[: a + 1])
            accepted.append(a)
            self._count(view, n, a)
        self.small.observe(views, accepted)
        return emitted, probs

    def _count(self, view: Sequence, drafted: int, accepted: int) -> None:
        """One middle-model forward of a row that verified ``drafted`` small-model tokens and kept ``accepted``."""
        for m in (view.metrics, self.metrics):
            if m is not None:
                m.inner_steps += 1
                m.inner_draft_tokens += drafted
                m.inner_accepted_tokens += accepted

    def observe(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        self.mid.observe(seqs, num_accepted)
        self.small.observe(seqs, num_accepted)

    def kv_pools(self) -> list:
        return [*self.small.kv_pools(), *self.mid.kv_pools()]

    def release(self, seq: Sequence) -> None:
        self.mid.release(seq)
        self.small.release(seq)
