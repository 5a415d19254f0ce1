"""A draft model with a tokenizer of its own: drafts in its token space, converted through text.

Design: this is not a method of its own. ``{"method": "draft_model"}`` loads the draft and
its tokenizer and, when that tokenizer's vocabulary differs from the target's, builds a
:class:`CrossTokenizerDrafter` instead of a :class:`DraftModelDrafter` (the user names the
draft, specdec picks the token mapping; the method stays listed once and the engine never
learns which of the two it got). Both share the draft's KV pool and release
(:class:`~specdec.drafters.draft_lm.DraftLM`); this one replaces how the context reaches the
draft and how its proposal reaches the target:

- the draft's context is the committed text (the target's tokens decoded) re-encoded with
  the draft's tokenizer; after each step the draft's KV pool is rolled back, in the draft's
  token space, to the longest common prefix of what it holds (the last context plus its
  drafts) and the new context, so only the new tokens are fed at the next ``propose``;
- the draft proposes greedily, ``k + 1`` tokens in its space; their text, appended to the
  last committed target tokens and encoded with the target's tokenizer, gives target tokens;
  kept are those after an exact reproduction of the committed tail, without the last one (a
  text cut may end it early), at most ``k``;
- the proposal is a deterministic draft (``probs`` None): verification treats it as one-hot,
  so greedy output is the target's greedy output and sampled output follows the target's
  distribution whatever the draft proposes. No random number is drawn for the draft.
"""

from __future__ import annotations

import torch

from specdec.drafters.base import DraftBatch, LoadOptions, SpeculativeConfig
from specdec.drafters.draft_lm import DraftLM
from specdec.errors import SpecDecError
from specdec.models.base import CausalLM, ForwardBatch, prefill_batches
from specdec.models.loader import load_tokenizer
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence
from specdec.verify import common_prefix

#: Committed target tokens re-encoded with a proposal: the merges across the boundary are the target's.
TAIL_TOKENS = 2
#: Draft tokens decoded before a proposal so that its text starts where the context's ends.
TEXT_TAIL_TOKENS = 8


def target_continuation(tokenizer, committed: list[int], text: str, limit: int, vocab_size: int) -> list[int]:
    """At most ``limit`` target tokens that extend ``committed`` (target token ids) by ``text``.

    The last ``TAIL_TOKENS`` committed tokens are decoded, ``text`` appended and the result encoded:
    when that reproduces the tail exactly, the tokens after it are the continuation, less the last
    one (the text may end inside a longer token) and cut before any id outside the target's
    ``vocab_size``. Anything else (a tail that does not round-trip, a proposal merging with the
    pending token) gives ``[]``: no draft, never a wrong one."""
    tail = committed[-TAIL_TOKENS:]
    head = tokenizer.decode(tail, clean_up_tokenization_spaces=False)
    ids = tokenizer.encode(head + text, add_special_tokens=False)
    if ids[: len(tail)] != tail:
        return []
    out = []
    for token in ids[len(tail) : -1][:limit]:
        if not 0 <= token < vocab_size:
            break
        out.append(token)
    return out


class CrossTokenizerDrafter(DraftLM):
    """A draft model whose tokenizer differs from the target's (built by ``draft_model``'s
    ``from_config``; see the module docstring). Per slot it keeps ``context`` (the committed
    text in draft tokens; absent while the pool holds nothing of the row, until it drafts) and
    ``fed`` (the draft tokens its KV pool holds, a prefix of the context plus the last drafts),
    with ``len(fed) < len(context)`` between steps."""

    description = "draft model with another tokenizer: drafts converted through text, verified as deterministic"

    def __init__(self, model: CausalLM, draft_tokenizer, target_tokenizer, target_vocab_size: int,
                 num_slots: int, max_model_len: int) -> None:
        super().__init__(model, num_slots, max_model_len)
        self.draft_tokenizer = draft_tokenizer
        self.target_tokenizer = target_tokenizer
        self.target_vocab_size = target_vocab_size
        self.context: dict[int, list[int]] = {}
        self.fed: dict[int, list[int]] = {}

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: CausalLM, options: LoadOptions) -> CrossTokenizerDrafter:
        """The draft of ``config``, whose tokenizer differs from the target's (``draft_model`` checks that)."""
        model = cls.load_model(config, target, options)
        return cls.of_loaded(config, model, load_tokenizer(config.model, required=True), target, options)

    @classmethod
    def of_loaded(cls, config: SpeculativeConfig, model: CausalLM, draft_tokenizer, target: CausalLM,
                  options: LoadOptions) -> CrossTokenizerDrafter:
        """Over a loaded draft ``model`` and its tokenizer; fields that need a shared vocabulary are refused."""
        for name in ("draft_confidence_threshold", "draft_vocab_size"):
            if getattr(config, name):
                raise SpecDecError(f"{name} is not supported with a draft whose tokenizer differs from the "
                                   f"target's (draft model {model.name!r})")
        return cls(model, draft_tokenizer, options.target_tokenizer, target.vocab_size, options.num_slots,
                   options.max_model_len)

    def _draft_context(self, seq: Sequence) -> list[int]:
        """The committed context (``seq.token_ids``, the pending token included) as draft tokens."""
        text = self.target_tokenizer.decode(seq.token_ids, skip_special_tokens=True,
                                            clean_up_tokenization_spaces=False)
        return self.draft_tokenizer.encode(text) if text else []

    def _proposal_text(self, context: list[int], drafts: list[int]) -> str:
        """The text ``drafts`` add after ``context`` (draft tokens); incomplete characters dropped."""
        tail = context[-TEXT_TAIL_TOKENS:]
        options = {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}
        base = self.draft_tokenizer.decode(tail, **options)
        full = self.draft_tokenizer.decode(tail + drafts, **options)
        return full[len(base):].rstrip("\ufffd") if full.startswith(base) else ""

    def add(self, seqs: list[Sequence]) -> None:
        """Start each slot empty. The prompt is encoded in the draft's tokens and fed by the row's first
        ``propose``, not here, as :meth:`DraftModelDrafter.add <specdec.drafters.draft_model.DraftModelDrafter.add>`
        does: a row that never drafts (speculation off, as auto k turns it at saturation) costs the draft
        nothing, neither a forward nor an encoding."""
        for s in seqs:
            self.cache.release(s.slot)
            self.context.pop(s.slot, None)
            self.fed[s.slot] = []

    def _context(self, seq: Sequence) -> list[int]:
        """The row's committed context in draft tokens, encoded now if no step has since it last changed."""
        if seq.slot not in self.context:
            self.context[seq.slot] = self._draft_context(seq)
        return self.context[seq.slot]

    def backlog(self, seqs: list[Sequence]) -> list[int]:
        """The draft tokens of each row's committed text that its pool does not hold (the pending one at least)."""
        return [len(self._context(s)) - len(self.fed[s.slot]) for s in seqs]

    def _drafting(self, seqs: list[Sequence], ks: list[int]) -> list[int]:
        """The rows that draft: asked to (``ks[b] > 0``), with a context, whose ``max(ks) + 1`` draft tokens fit
        the draft's context."""
        width = max(ks, default=0) + 1
        return [b for b, (s, k) in enumerate(zip(seqs, ks))
                if k > 0 and (context := self._context(s)) and len(context) + width - 1 <= self.capacity]

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Feed each row's context the pool lacks but its last two draft tokens in prefill forwards, as the draft
        model's :meth:`~specdec.drafters.draft_model.DraftModelDrafter._catch_up` does: the proposal's own
        forward then feeds at most two tokens a row."""
        rows = [s for s in seqs if len(self.context[s.slot]) - 2 > len(self.fed[s.slot])]
        starts = [len(self.fed[s.slot]) for s in rows]
        for batch in prefill_batches([self.context[s.slot][c:-2] for s, c in zip(rows, starts)],
                                     [s.slot for s in rows], self.model.device, starts=starts):
            self.model.forward(batch, self.cache)
        for s in rows:
            self.fed[s.slot] = self.context[s.slot][:-2]

    def propose(self, seqs: list[Sequence], ks: list[int], sampling: SamplingBatch) -> DraftBatch:
        """Greedy ``ks[b] + 1`` draft tokens per row in one chain (the longest row's length), converted
        to at most ``ks[b]`` target tokens; ``sampling`` is unused (the draft is deterministic). Prompts
        beyond the draft's context are never drafted for."""
        width = max(ks, default=0) + 1
        active = self._drafting(seqs, ks)
        rows: list[list[int]] = [[] for _ in seqs]
        if active:
            self._catch_up([seqs[b] for b in active])  # nothing left to feed where the engine called catch_up
            slots = [seqs[b].slot for b in active]
            new = [self.context[slot][len(self.fed[slot]):] for slot in slots]
            batch = ForwardBatch.from_rows(new, [len(self.fed[slot]) for slot in slots], slots, self.model.device,
                                           logits="last")
            first = self.model.forward(batch, self.cache).logits.argmax(-1)
            drafts = first[:, None]
            if width > 1:
                drafts = torch.cat([drafts, self.model.greedy_chain(first, slots, self.cache, width - 1)], dim=1)
            for b, slot, chain in zip(active, slots, drafts.tolist()):
                context = self.context[slot]
                self.fed[slot] = context + chain[: width - 1]
                text = self._proposal_text(context, chain[: ks[b] + 1])
                if text:
                    rows[b] = target_continuation(self.target_tokenizer, seqs[b].token_ids, text, ks[b],
                                                  self.target_vocab_size)
        return DraftBatch.from_lists(rows, self.model.device)

    def observe(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        """Re-encode the new committed text and roll the draft's pool back to what it shares with it (a row
        whose pool holds nothing is encoded when it next drafts)."""
        for s in seqs:
            fed = self.fed[s.slot]
            if not fed:
                self.context.pop(s.slot, None)
                continue
            context = self._draft_context(s)
            keep = max(0, min(common_prefix(fed, context), len(context) - 1))
            self.cache.set_length(s.slot, min(keep, self.cache.lengths[s.slot]))
            self.fed[s.slot] = fed[: self.cache.lengths[s.slot]]
            self.context[s.slot] = context

    def release(self, seq: Sequence) -> None:
        super().release(seq)
        self.context.pop(seq.slot, None)
        self.fed.pop(seq.slot, None)
