"""A separate, smaller causal LM that samples the draft from its own distribution ``q``."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from specdec.argmax import argmax
from specdec.drafters.base import (
    DraftBatch,
    LoadOptions,
    SpeculativeConfig,
    draft_probs,
    draw_column,
    narrow_rows,
    register_drafter,
)
from specdec.drafters.cross_tokenizer import CrossTokenizerDrafter
from specdec.drafters.draft_lm import DraftLM
from specdec.drafters.draft_vocab import DraftVocab, full_logits, head_rows
from specdec.errors import SpecDecError
from specdec.models.base import CausalLM, ForwardBatch, prefill_batches, to_device
from specdec.models.families import FAST_BACKEND
from specdec.models.grid import WIDE_TOKENS
from specdec.models.loader import load_tokenizer
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence

FOLD_WIDTH = WIDE_TOKENS
"""The most positions a row's backlog may hold for its catch-up to be fed by the proposal's own forward
(:meth:`DraftModelDrafter._folds`): a CPU chain forward's widest row not bucketed like a prefill's."""
FOLD_CELLS = 64
"""The most grid cells a folded catch-up may add to the proposal's first forward (rows x positions beyond two). At
the ``1b`` shape's draft in bfloat16 on a 2-core CPU a forward of two tokens a row took 0.024 s at 1 row, 0.024 s at
4, 0.043 s at 16 and 0.077 s at 64; three tokens a row 0.023, 0.026, 0.048 and 0.078 s; four 0.021, 0.028, 0.054 and
0.087 s; eight 0.022, 0.028, 0.061 and 0.137 s: 64 cells more cost about 0.01 s or less, a catch-up forward of its own
0.02 s or more (``docs/lab-notes/2026-11-30-folded-catch-up.md``)."""


@register_drafter
class DraftModelDrafter(DraftLM):
    """Runs a smaller causal LM autoregressively: one batched forward per draft position.

    The draft model has its own KV pool, slot for slot the target's, under the target's
    invariant: a slot holds a prefix of the committed context, plus the drafts of the
    current step. ``propose`` first feeds each drafting row's committed tokens not cached yet (its
    prompt on its first draft; the pending token; after a fully accepted step the last draft too;
    more after a step the row sat out), then one token per row per draft position; ``observe``
    rolls back the drafts that were rejected. A row draws from its generator only for its own
    ``ks[b]`` drafts. A draft whose tokenizer differs from the target's is built as a
    :class:`~specdec.drafters.cross_tokenizer.CrossTokenizerDrafter` (drafts converted through text).
    With a draft vocabulary (``draft_vocab_size``, or the default stored with the draft folder's token
    counts; :mod:`specdec.drafters.draft_vocab`) every draft forward scores only those rows of the
    draft's output head (fast backend; a folder's default is not used under CUDA graphs, where a
    draft forward is bound by launches, not by its head).
    """

    method = "draft_model"
    description = "draft model: a smaller LM with the target's vocabulary samples k tokens"
    needs_model = True
    draft_lm = True
    confidence_stop = True
    draft_vocab = True

    def __init__(self, model: CausalLM, num_slots: int, max_model_len: int, threshold: float | None = None,
                 vocab: DraftVocab | None = None, num_blocks: int | None = None, prefix_caching: bool = False) -> None:
        super().__init__(model, num_slots, max_model_len, num_blocks, prefix_caching)
        self.threshold = threshold
        self.vocab = vocab

    @classmethod
    def check_config(cls, config: SpeculativeConfig) -> None:
        if config.model is None or config.model == "":
            raise SpecDecError("speculative method 'draft_model' needs a draft 'model' (a folder or hub id)")

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: CausalLM,
                    options: LoadOptions) -> DraftModelDrafter | CrossTokenizerDrafter:
        model = cls.load_model(config, target, options)
        draft_tokenizer = load_tokenizer(config.model, required=False)
        target_tokenizer = options.target_tokenizer
        if (draft_tokenizer is not None and target_tokenizer is not None
                and draft_tokenizer.get_vocab() != target_tokenizer.get_vocab()):
            return CrossTokenizerDrafter.of_loaded(config, model, draft_tokenizer, target, options)
        if model.vocab_size != target.vocab_size:
            missing = ("the draft has no tokenizer" if draft_tokenizer is None
                       else "the target has no tokenizer" if target_tokenizer is None else "")
            why = f" ({missing}, so its tokens cannot be converted through text)" if missing else ""
            raise SpecDecError(
                f"draft model {model.name!r} has a vocabulary of {model.vocab_size} tokens but the target "
                f"{target.name!r} has {target.vocab_size}{why}; the draft and the target must share a vocabulary"
            )
        blocks = None if options.kv_budget is None else options.kv_budget.blocks(model.kv_bytes_per_token() or 0)
        return cls(model, options.num_slots, options.max_model_len, config.draft_confidence_threshold,
                   cls._vocab(config, model), blocks, options.prefix_caching)

    @staticmethod
    def _vocab(config: SpeculativeConfig, model: CausalLM) -> DraftVocab | None:
        """The draft vocabulary of ``config`` for ``model`` from its folder's counts, or None. A folder's
        default is left unused on a backend that cannot score part of the head (an explicit size is refused
        there) and under CUDA graphs, which the draft's forwards would lose (an explicit size turns them off)."""
        size = config.draft_vocab_size
        if size == 0 or (size is None and getattr(model, "use_cuda_graphs", False)):
            return None
        source = getattr(config.model, "name_or_path", config.model)  # a loaded model: the folder it came from
        folder = Path(source) if isinstance(source, (str, os.PathLike)) and Path(source).is_dir() else None
        if not model.supports_layer_subsets:
            if size is None:
                return None
            raise SpecDecError(f"draft_vocab_size needs the draft model on {FAST_BACKEND}; "
                               f"{model.name!r} runs on {type(model).__name__}")
        return DraftVocab.load(folder, size, model.lm_head)

    def add(self, seqs: list[Sequence]) -> None:
        """Start each slot from the blocks the prefix cache holds of the prompt (prompts longer than the draft's
        context are left for ``propose`` to skip). The rest of the context is fed by the row's first
        ``propose``, not here: a row that never drafts (speculation off, as auto k turns it at saturation) costs
        the draft nothing. Prefilling every prompt here took 4.3% of a 64-stream run at the ``1b`` shape with
        speculation off on 98% of the steps (``docs/lab-notes/2026-11-29-probes.md``)."""
        for s in seqs:
            self.cache.release(s.slot)
            if 1 < len(s.prompt_ids) <= self.capacity:
                self.cache.match_prefix(s.slot, s.prompt_ids)

    def backlog(self, seqs: list[Sequence]) -> list[int]:
        """The committed tokens each row's slot has not cached (the pending token at least)."""
        return [len(s.token_ids) - self.cache.lengths[s.slot] for s in seqs]

    def _fitting(self, seqs: list[Sequence], ks: list[int]) -> list[int]:
        """``ks`` cut to what each row's slot can still hold: the context so far plus ``k - 1`` drafts."""
        return [max(0, min(k, self.capacity + 1 - len(s.token_ids))) for s, k in zip(seqs, ks)]

    def _drafting(self, seqs: list[Sequence], ks: list[int]) -> list[int]:
        """The rows with a draft position left once ``ks`` is cut to their slots (:meth:`_fitting`)."""
        return [b for b, k in enumerate(self._fitting(seqs, ks)) if k > 0]

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Feed each row's committed tokens the slot lacks but its last two (a prompt, the tokens of the steps it
        sat out) in prefill forwards, as few as :data:`~specdec.models.base.PREFILL_TOKEN_BUDGET` allows: the
        proposal's own forward then feeds at most two tokens a row, the shape of every step after a draft. Where
        the proposal's forward can feed the whole backlog for little more (:meth:`_folds`), nothing is fed here."""
        if self._folds(seqs):
            return
        fed = [(s.token_ids[c:-2], c, s.slot) for s in seqs
               if len(s.token_ids) - 2 > (c := self.cache.lengths[s.slot])]
        for batch in prefill_batches([f[0] for f in fed], [f[2] for f in fed], self.model.device,
                                     starts=[f[1] for f in fed]):
            self.model.forward(batch, self.cache)

    def _folds(self, seqs: list[Sequence]) -> bool:
        """Whether the proposal's first forward feeds the rows ``seqs`` (those drafting) their whole backlog, a
        catch-up of a few positions (the steps a row sat out) costing no forward of its own: where the backlog is
        more than the two tokens a row, the widest row's is at most :data:`FOLD_WIDTH` and the grid's cells beyond
        the two-token forward's (``rows x`` the extra width) at most :data:`FOLD_CELLS`. Not under CUDA graphs,
        whose captured shapes serve the two-token forward."""
        if getattr(self.model, "use_cuda_graphs", False):
            return False
        behind = self.backlog(seqs)
        widest = max(behind, default=0)
        return 2 < widest <= FOLD_WIDTH and len(seqs) * (widest - 2) <= FOLD_CELLS

    def propose(self, seqs: list[Sequence], ks: list[int], sampling: SamplingBatch) -> DraftBatch:
        ks = self._fitting(seqs, ks)
        active = [b for b, k in enumerate(ks) if k > 0]
        width = max(ks, default=0)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long, device=self.model.device)
        if not active:
            return DraftBatch(tokens, ks)
        rows = sampling.select(active) if len(active) < len(seqs) else sampling
        self._catch_up([seqs[b] for b in active])  # nothing left to feed where the engine called catch_up
        cached = [self.cache.lengths[seqs[b].slot] for b in active]
        batch = ForwardBatch.from_rows([seqs[b].token_ids[c:] for b, c in zip(active, cached)], cached,
                                       [seqs[b].slot for b in active], self.model.device, logits="last")
        logits = self.forward(batch)
        if rows.all_greedy and self.threshold is None and not rows.shapes_drafts and all(
                len(seqs[b].token_ids) + width - 1 <= self.capacity for b in active):
            # The whole greedy proposal after the first token in one call (one graph on a GPU; a row under a
            # constraint or with penalties takes the loop below, which masks or adjusts each draft token), every
            # row to the longest row's width: a row keeps its own first ks[b] tokens (greedy tokens do not
            # depend on how far the chain goes; the extra entries in its slot are rolled back by observe).
            first = argmax(logits)
            drafts = first[:, None]
            if width > 1:
                ids = None if self.vocab is None else self.vocab.ids
                chain = self.model.greedy_chain(first, [seqs[b].slot for b in active], self.cache, width - 1,
                                                head_rows(self.vocab), ids)
                drafts = torch.cat([drafts, chain], dim=1)
            if len(active) == len(seqs):
                return DraftBatch(drafts, ks)
            tokens[to_device(active, self.model.device)] = drafts
            return DraftBatch(tokens, ks)
        index = to_device(active, self.model.device)
        probs = None
        if not rows.all_greedy:
            probs = draft_probs(logits, len(seqs), width, logits.shape[-1])
        for i in range(width):
            if self.threshold is not None:
                sure = self._confident(logits, i, ks, active)
                if not sure:
                    break
                active, rows, (logits, index) = narrow_rows(sure, active, rows, logits, index)
            token = draw_column(logits, rows, probs, index, i, tokens)  # every row in ``active`` drafts token i
            still = [j for j, b in enumerate(active) if ks[b] > i + 1]
            if not still:
                break
            active, rows, (token, index) = narrow_rows(still, active, rows, token, index)
            step = ForwardBatch.one_token_per_row(token, [seqs[b].slot for b in active], self.cache)
            logits = self.forward(step)
        width = max(ks)
        return DraftBatch(tokens[:, :width], ks, None if probs is None else probs[:, :width])

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The draft's forward over its pool: logits ``[M, V]`` (``-inf`` outside the draft vocabulary)."""
        batch.output_head = head_rows(self.vocab)
        return full_logits(self.vocab, self.model.forward(batch, self.cache).logits)

    def _confident(self, logits: torch.Tensor, i: int, ks: list[int], active: list[int]) -> list[int]:
        """Early stop (``draft_confidence_threshold``): a row ``active[j]`` whose top draft probability
        (temperature 1) for its token ``i`` (``logits[j]``, ``[len(active), V]``) is below the threshold
        drafts ``i`` tokens (``ks`` updated in place). The decision is taken before ``d_i`` is drawn,
        from the draft's context alone, so verification stays exact. Returns the ``j`` that draft on
        (one host sync per position)."""
        sure = (logits.softmax(-1).amax(-1) >= self.threshold).tolist()
        for b, ok in zip(active, sure):
            if not ok:
                ks[b] = i
        return [j for j, ok in enumerate(sure) if ok]

    def observe(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        for s in seqs:
            slot = s.slot
            self.cache.set_length(slot, min(self.cache.lengths[slot], len(s.token_ids) - 1))
            self.cache.commit_prefix(slot, s.token_ids)
