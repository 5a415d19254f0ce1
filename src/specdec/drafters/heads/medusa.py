"""Medusa: ``K`` heads on the feature of the token before the pending one; head ``i`` drafts ``d_i``."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.drafters.base import DraftBatch, LoadOptions, draft_probs, draw_column, register_drafter
from specdec.drafters.heads.common import HeadDrafter, HeadSpec, load_module
from specdec.drafters.heads.modules import MedusaHeads
from specdec.models.base import CausalLM, to_device
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence


@register_drafter
class MedusaDrafter(HeadDrafter):
    """Chain drafts from Medusa heads: with ``f`` the target's feature of position ``L - 2`` (the token
    before the pending token ``t_{L-1}``, which the target's own head drew from ``f``), head ``i``
    proposes the token of position ``L - 1 + i``. The heads see neither the pending token nor earlier
    drafts, so a sampled draft ``d_i`` is drawn from head ``i``'s distribution alone; that is a valid
    proposal for exact chain verification (any ``q_i`` that does not look at the target's later tokens).
    A row drafts at most ``K`` tokens; a one-token prompt drafts nothing at its first step."""

    method = "medusa"
    description = "Medusa heads on the target's last hidden state (trained folder; embedded for the default pair)"

    @classmethod
    def build(cls, target: CausalLM, spec: HeadSpec, state: dict[str, torch.Tensor], folder: Path,
              options: LoadOptions) -> MedusaDrafter:
        module = MedusaHeads(spec.hidden_size, spec.num_heads).to(target.device, target.dtype)
        return cls(target, spec, load_module(module, state, folder))

    def propose(self, seqs: list[Sequence], ks: list[int], sampling: SamplingBatch) -> DraftBatch:
        device = self.target.device
        features = [self.last_feature(s) for s in seqs]
        ks = [min(k, self.spec.num_heads) if f is not None else 0 for k, f in zip(ks, features)]
        active = [b for b, k in enumerate(ks) if k > 0]
        width = max(ks, default=0)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
        if not active:
            return DraftBatch(tokens, ks)
        rows = sampling.select(active) if len(active) < len(seqs) else sampling
        with torch.inference_mode():
            heads = self.module(torch.stack([features[b] for b in active]))[:, :width]  # [A, K, H]
            logits = F.linear(heads, self.lm_head)  # [A, K, V]
        index = to_device(active, device)
        probs = None
        if rows.all_greedy:
            tokens[index] = logits.argmax(-1)
        else:
            probs = draft_probs(logits, len(seqs), width, logits.shape[-1])
            for i in range(width):  # a row draws only its own ks[b] tokens from its generator
                keep = [j for j, b in enumerate(active) if ks[b] > i]
                part = to_device(keep, device)
                draw_column(logits[part, i], rows.select(keep), probs, index[part], i, tokens)
        return DraftBatch(tokens, ks, probs)
