"""MTP: DeepSeek-V3-style multi-token prediction modules, chained sequentially for chain drafts."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.drafters.base import DraftBatch, LoadOptions, draft_probs, draw_column, narrow_rows, register_drafter
from specdec.drafters.heads.common import HeadDrafter, HeadSpec, load_module
from specdec.drafters.heads.modules import MTPModules
from specdec.models.base import CausalLM, to_device
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence


@register_drafter
class MTPDrafter(HeadDrafter):
    """Chain drafts from MTP modules: depth 1 combines the target's feature of the token before the
    pending one with the pending token's embedding and scores ``d_1`` under the target's head; depth
    ``k`` combines depth ``k - 1``'s feature with ``d_{k-1}``. Depths past the trained ones reuse the
    last module. Sampled rows draw from each depth's distribution ``q`` (returned for verification)."""

    method = "mtp"
    description = ("MTP: sequential multi-token-prediction modules on the target's hidden states "
                   "(trained folder; embedded for the default pair)")

    @classmethod
    def build(cls, target: CausalLM, spec: HeadSpec, state: dict[str, torch.Tensor], folder: Path,
              options: LoadOptions) -> MTPDrafter:
        module = MTPModules(spec.hidden_size, spec.intermediate_size, spec.num_heads, spec.rms_norm_eps)
        return cls(target, spec, load_module(module.to(target.device, target.dtype), state, folder))

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int], sampling: SamplingBatch) -> DraftBatch:
        device = self.target.device
        features = [self.last_feature(s) for s in seqs]
        ks = [k if f is not None else 0 for k, f in zip(ks, features)]
        active = [b for b, k in enumerate(ks) if k > 0]
        width = max(ks, default=0)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
        if not active:
            return DraftBatch(tokens, ks)
        rows = sampling.select(active) if len(active) < len(seqs) else sampling
        feature = torch.stack([features[b] for b in active])
        token = to_device([seqs[b].token_ids[-1] for b in active], device)
        index = to_device(active, device)
        probs = None
        if not rows.all_greedy:
            probs = draft_probs(feature, len(seqs), width, self.lm_head.shape[0])
        for i in range(width):
            feature = self.module.depth(i)(feature, F.embedding(token, self.embed))
            token = draw_column(self.logits(feature), rows, probs, index, i, tokens)
            still = [j for j, b in enumerate(active) if ks[b] > i + 1]
            if not still:
                break
            active, rows, (token, feature, index) = narrow_rows(still, active, rows, token, feature, index)
        return DraftBatch(tokens, ks, probs)
