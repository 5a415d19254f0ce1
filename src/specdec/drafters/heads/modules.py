"""The trainable parts of the head drafters, as plain ``torch.nn`` modules shared by inference and
training. Every module maps the target's *features* (its final, normed hidden state, ``[..., H]``,
the vector its output head turns into logits) to new features; the caller applies the target's own
output head (``lm_head`` ``[V, H]``) to get logits, so no module stores a vocabulary matrix.

- :class:`MedusaHeads`: ``K`` residual blocks on the feature of position ``j``; block ``i`` (from 1)
  predicts the token ``i + 1`` positions after ``j`` (the target's head itself predicts the first).
- :class:`EagleLayer`: one Llama decoder layer over ``fc([feature_j; embed(t_{j+1})])``, causal over
  the sequence, whose normed output predicts the feature of position ``j + 1``; autoregressive on its
  own predictions while drafting. It is a one-layer ``LlamaForCausalLM`` whose embedding and output
  head are the target's (frozen, never saved), so specdec's fast backend runs it with its own KV pool.
  With ``num_fused`` target layers (EAGLE-3), ``f_j`` is ``fuse([h^1_j; ...; h^n_j])``, a linear map of
  those layers' hidden states, instead of the final feature; its own predictions (while drafting, and in
  training's second pass) take ``f``'s place as they are.
- :class:`MTPModules`: DeepSeek-V3's multi-token prediction modules chained sequentially: module
  ``k`` combines the previous depth's feature of position ``j`` with ``embed(t_{j+k})`` and predicts
  the feature that scores ``t_{j+k+1}``. Here each module's block is a SwiGLU MLP without attention
  (so it keeps no cache); depths beyond the last module reuse it.
- :class:`EarlyExitAdapter`: a residual SwiGLU MLP on the target's hidden state after an early exit
  layer ``L``, followed by the target's own final norm and head (the trained early-exit form of
  ``layer_skip``). Stateless, so the draft keeps no cache of its own beyond the target's pool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM


class MedusaHeads(nn.Module):
    """``num_heads`` blocks ``f + silu(W_i f)``, zero-initialised (each starts as the target's head)."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        for block in self.blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """``features`` ``[..., H]`` -> ``[..., K, H]``: head ``i``'s feature for the token ``i + 2`` ahead."""
        return torch.stack([features + F.silu(block(features)) for block in self.blocks], dim=-2)


class EagleLayer(nn.Module):
    """``fc`` ``[H, 2H]`` and a one-layer Llama (``decoder``) sharing the target's embedding and head;
    with ``num_fused`` > 0 also ``fuse`` ``[H, num_fused * H]`` (EAGLE-3's feature fusion)."""

    def __init__(self, config: LlamaConfig, embed: torch.Tensor, lm_head: torch.Tensor, num_fused: int = 0) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.fuse = nn.Linear(num_fused * hidden, hidden, bias=False) if num_fused else None
        config.tie_word_embeddings = False
        self.decoder = LlamaForCausalLM(config)  # initialised as transformers does (std 0.02, norms 1)
        self.to(device=embed.device, dtype=embed.dtype)
        self.decoder.model.embed_tokens.weight = nn.Parameter(embed, requires_grad=False)
        self.decoder.lm_head.weight = nn.Parameter(lm_head, requires_grad=False)

    def fused(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The feature ``[..., H]`` of the target's hidden states ``[..., F * H]`` (the ``F`` layers side by
        side; without fusion ``F`` is 1 and they are the feature)."""
        return target_hidden if self.fuse is None else self.fuse(target_hidden)

    def inputs(self, features: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """The decoder layer's input ``[..., H]`` from features and next-token embeddings ``[..., H]``."""
        return self.fc(torch.cat([features, embeddings], dim=-1))

    def forward(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced training pass: ``features`` ``[B, T, H]`` of positions ``j`` and ``tokens``
        ``[B, T]`` (``t_{j+1}``) -> predicted features of positions ``j + 1``, ``[B, T, H]``."""
        embeddings = F.embedding(tokens, self.decoder.model.embed_tokens.weight)
        out = self.decoder.model(inputs_embeds=self.inputs(features, embeddings), use_cache=False)
        return out.last_hidden_state

    def trained_state(self) -> dict[str, torch.Tensor]:
        """The weights to save: everything but the target's embedding and head."""
        shared = {"decoder.model.embed_tokens.weight", "decoder.lm_head.weight"}
        return {k: v for k, v in self.state_dict().items() if k not in shared}


class MTPModule(nn.Module):
    """One depth: ``norm_out(u + down(silu(gate(norm(u))) * up(norm(u))))`` with
    ``u = proj([norm_h(h); norm_e(e)])``."""

    def __init__(self, hidden_size: int, intermediate_size: int, eps: float) -> None:
        super().__init__()
        self.norm_h = nn.RMSNorm(hidden_size, eps=eps)
        self.norm_e = nn.RMSNorm(hidden_size, eps=eps)
        self.proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.norm_mlp = nn.RMSNorm(hidden_size, eps=eps)
        self.gate_up = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.norm_out = nn.RMSNorm(hidden_size, eps=eps)

    def forward(self, features: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` features of depth ``k - 1`` and embeddings of ``t_{j+k}`` -> features of depth ``k``."""
        u = self.proj(torch.cat([self.norm_h(features), self.norm_e(embeddings)], dim=-1))
        gate, up = self.gate_up(self.norm_mlp(u)).chunk(2, dim=-1)
        return self.norm_out(u + self.down(F.silu(gate) * up))


class MTPModules(nn.Module):
    """``num_modules`` sequential :class:`MTPModule` depths."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_modules: int, eps: float) -> None:
        super().__init__()
        self.depths = nn.ModuleList(MTPModule(hidden_size, intermediate_size, eps) for _ in range(num_modules))

    def depth(self, k: int) -> MTPModule:
        """The module of depth ``k`` (from 0); depths past the last reuse it."""
        return self.depths[min(k, len(self.depths) - 1)]


class EarlyExitAdapter(nn.Module):
    """``h + down(silu(gate(norm(h))) * up(norm(h)))`` on the output ``h`` ``[..., H]`` of an early exit
    layer; ``down`` starts at zero, so an untrained adapter is the plain early exit."""

    def __init__(self, hidden_size: int, intermediate_size: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        self.gate_up = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)
        nn.init.zeros_(self.down.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> ``[..., H]``: the input of the target's final norm and head."""
        gate, up = self.gate_up(self.norm(hidden)).chunk(2, dim=-1)
        return hidden + self.down(F.silu(gate) * up)
