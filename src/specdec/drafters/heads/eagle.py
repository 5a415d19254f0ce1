"""EAGLE: a one-layer autoregressive drafter on the target's features, with its own KV pool."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from specdec.drafters.base import DraftBatch, LoadOptions, draft_probs, draw_column, register_drafter
from specdec.drafters.heads.common import HeadDrafter, HeadSpec, load_module, target_weights
from specdec.drafters.heads.modules import EagleLayer
from specdec.models.base import CausalLM, ForwardBatch, to_device
from specdec.models.fast_llama import FastLlamaLM
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence


def eagle_config(spec: HeadSpec) -> LlamaConfig:
    """The one-layer Llama config of the eagle layer of ``spec``."""
    layer = {k: v for k, v in spec.layer.items() if v is not None}
    return LlamaConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                       intermediate_size=spec.intermediate_size, num_hidden_layers=1,
                       rms_norm_eps=spec.rms_norm_eps, **layer)


@register_drafter
class EagleDrafter(HeadDrafter):
    """Chain drafts from an EAGLE layer run by specdec's fast backend over its own KV pool.

    Entry ``j`` of a slot is the layer's key/value for the pair ``(f_j, t_{j+1})``: the target's
    feature of position ``j`` and the token after it. The pool holds the pairs of every position
    whose feature the target has computed (all committed tokens but the pending one). ``propose``
    first feeds each row's new pairs (its prompt, or the step's verified positions, the last pair
    ending in the pending token); the layer's output there predicts the feature of the pending
    position, whose logits under the target's head give ``d_1``; each further draft feeds
    ``(predicted feature, d_i)``. Afterwards the pool is set back to the target-feature pairs.
    Sampled rows draw from the layer's distribution ``q`` (returned for exact verification)."""

    method = "eagle"
    description = ("EAGLE: one-layer feature drafter on the target's hidden states "
                   "(trained folder; embedded for the default pair)")

    def __init__(self, target: CausalLM, spec: HeadSpec, module: EagleLayer, num_slots: int, capacity: int) -> None:
        super().__init__(target, spec, module)
        self.layer = FastLlamaLM(module.decoder, f"eagle layer of {target.name}", use_cuda_graphs=False)
        self.cache = self.layer.new_cache(num_slots, capacity)

    @classmethod
    def build(cls, target: CausalLM, spec: HeadSpec, state: dict[str, torch.Tensor], folder: Path,
              options: LoadOptions) -> EagleDrafter:
        embed, lm_head = target_weights(target)
        module = load_module(EagleLayer(eagle_config(spec), embed, lm_head), state, folder)
        return cls(target, spec, module, options.num_slots, options.max_model_len)

    def add(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.cache.release(s.slot)

    def release(self, seq: Sequence) -> None:
        super().release(seq)
        self.cache.release(seq.slot)

    def _inputs(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.module.inputs(features, F.embedding(tokens, self.embed))

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int], sampling: SamplingBatch) -> DraftBatch:
        device, cache = self.target.device, self.cache
        width = max(ks, default=0)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
        # 1. Each row's new (feature, next token) pairs, ragged, into the pool.
        fed, features, pair_tokens, positions, cu = [], [], [], [], [0]
        for b, s in enumerate(seqs):
            new = self.take_features(s)
            if new is None:
                continue
            start = cache.lengths[s.slot]
            fed.append(b)
            features.append(new)
            pair_tokens.extend(s.token_ids[start + 1 : start + 1 + new.shape[0]])
            positions.extend(range(start, start + new.shape[0]))
            cu.append(cu[-1] + new.shape[0])
        ks = [k if b in fed else 0 for b, k in enumerate(ks)]
        if not fed:
            return DraftBatch(tokens, ks)
        host = to_device(pair_tokens + positions + [c - 1 for c in cu[1:]], device)
        n = len(pair_tokens)
        batch = ForwardBatch(host[:n], host[n : 2 * n], [seqs[b].slot for b in fed], cu,
                             logits_rows=host[2 * n :], hidden_layers=(-1,))
        batch.input_hidden = self._inputs(torch.cat(features), host[:n])
        committed = {seqs[b].slot: cache.lengths[seqs[b].slot] + c for b, c in zip(fed, batch.num_tokens)}
        out = self.layer.forward(batch, cache)
        # 2. Draft autoregressively, the rows that still draft feeding (predicted feature, last draft).
        keep = [j for j, b in enumerate(fed) if ks[b] > 0]
        active = [fed[j] for j in keep]
        probs = None
        if active:
            part = to_device(keep, device)
            logits, feature = out.logits[part], out.hidden[part, 0]
            rows = sampling.select(active) if len(active) < len(seqs) else sampling
            if not rows.all_greedy:
                probs = draft_probs(logits, len(seqs), width, logits.shape[-1])
            index = to_device(active, device)
            for i in range(width):
                token = draw_column(logits, rows, probs, index, i, tokens)
                still = [j for j, b in enumerate(active) if ks[b] > i + 1]
                if not still:
                    break
                if len(still) < len(active):
                    part = to_device(still, device)
                    token, feature, index, rows = token[part], feature[part], index[part], rows.select(still)
                    active = [active[j] for j in still]
                step = ForwardBatch.one_token_per_row(token, [seqs[b].slot for b in active], cache)
                step.hidden_layers = (-1,)
                step.input_hidden = self._inputs(feature, token)
                out = self.layer.forward(step, cache)
                logits, feature = out.logits, out.hidden[:, 0]
        for slot, length in committed.items():
            cache.set_length(slot, length)
        return DraftBatch(tokens, ks, probs)
