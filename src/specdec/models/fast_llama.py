"""A fast backend for the Llama family (Llama, Qwen2): a static KV cache and a lean forward.

It reads the weights of a loaded transformers model (no forked modeling file, no copy of
the weights beyond fusing q/k/v and gate/up projections) and runs the same arithmetic as
transformers' eager forward with far fewer Python calls per layer. The cache is a
preallocated tensor per layer; rollback (``crop``) only moves the length, as in gpt-fast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specdec.models.base import CachedLM
from specdec.models.hf import context_window

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


def unsupported_reason(config) -> str | None:
    """Why the fast backend cannot run this config, or None if it can."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not silu"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention is not supported"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") in ("dynamic", "longrope"):
        return f"rope type {rope['rope_type']!r} depends on the sequence length"
    return None


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_weight: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None


def _cat_bias(*modules: torch.nn.Linear) -> torch.Tensor | None:
    if all(m.bias is None for m in modules):
        return None
    return torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in modules])


class FastLlamaLM(CachedLM):
    """Static-cache forward for ``LlamaForCausalLM``/``Qwen2ForCausalLM`` weights."""

    def __init__(self, model: PreTrainedModel, name: str) -> None:
        config = model.config
        self.config = config
        self.name = name
        self.device = model.device
        self.dtype = model.dtype
        self.max_length = context_window(config)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        base = model.model
        self.embed = base.embed_tokens.weight
        self.final_norm = base.norm.weight
        self.lm_head = model.lm_head.weight
        self.vocab_size = self.lm_head.shape[0]
        self.layers = []
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    input_norm=layer.input_layernorm.weight,
                    qkv_weight=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                    qkv_bias=_cat_bias(attn.q_proj, attn.k_proj, attn.v_proj),
                    o_weight=attn.o_proj.weight,
                    o_bias=attn.o_proj.bias,
                    post_norm=layer.post_attention_layernorm.weight,
                    gate_up_weight=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                    gate_up_bias=_cat_bias(mlp.gate_proj, mlp.up_proj),
                    down_weight=mlp.down_proj.weight,
                    down_bias=mlp.down_proj.bias,
                )
            )
        # cos/sin for every position, computed once by the model's own rotary module.
        with torch.no_grad():
            positions = torch.arange(self.max_length, device=self.device)[None]
            probe = torch.empty(0, device=self.device, dtype=self.dtype)
            cos, sin = base.rotary_emb(probe, positions)
        # rotate_half(x) * sin == x.roll(half) * [-sin_lo, sin_hi]: one roll instead of slices and a cat.
        half = self.head_dim // 2
        self.cos = cos[0]
        self.sin_signed = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
        self._capacity = 0
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def reset(self) -> None:
        self._length = 0

    def crop(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot crop a cache of {self._length} tokens to {length}")
        self._length = length

    def _reserve(self, needed: int) -> None:
        """Grow the preallocated cache (doubling, capped at the context window) to hold ``needed`` tokens."""
        if needed <= self._capacity:
            return
        capacity = min(self.max_length, max(needed, 2 * self._capacity, 256))
        shape = (1, self.num_kv_heads, capacity, self.head_dim)
        keys, values = [], []
        for i in range(len(self.layers)):
            k = torch.empty(shape, device=self.device, dtype=self.dtype)
            v = torch.empty(shape, device=self.device, dtype=self.dtype)
            if self._capacity:
                k[:, :, : self._length] = self._keys[i][:, :, : self._length]
                v[:, :, : self._length] = self._values[i][:, :, : self._length]
            keys.append(k)
            values.append(v)
        self._keys, self._values, self._capacity = keys, values, capacity

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # LlamaRMSNorm's arithmetic: statistics in float32, then the weight in the model dtype.
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, self.eps)
        return weight * F.rms_norm(x.float(), weight.shape, None, self.eps).to(x.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, num_logits: int | None = None) -> torch.Tensor:
        start, steps = self._length, input_ids.shape[1]
        end = start + steps
        if end > self.max_length:
            raise ValueError(f"{self.name}: {end} tokens exceed the context window of {self.max_length}")
        self._reserve(end)
        cos, sin = self.cos[start:end], self.sin_signed[start:end]
        if steps == 1:
            mask = None
        else:
            rows = torch.arange(start, end, device=self.device)[:, None]
            mask = torch.arange(end, device=self.device)[None, :] <= rows
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(input_ids, self.embed)
        for i, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.input_norm)
            qkv = F.linear(h, layer.qkv_weight, layer.qkv_bias)
            qk, v = qkv.view(1, steps, nh + 2 * nkv, hd).transpose(1, 2).split((nh + nkv, nkv), dim=1)
            qk = qk * cos + qk.roll(hd // 2, dims=-1) * sin
            q, k = qk.split((nh, nkv), dim=1)
            keys, values = self._keys[i], self._values[i]
            keys[:, :, start:end] = k
            values[:, :, start:end] = v
            attn = F.scaled_dot_product_attention(
                q, keys[:, :, :end], values[:, :, :end], attn_mask=mask, scale=self.scale,
                enable_gqa=nkv != nh,
            )
            x = x + F.linear(attn.transpose(1, 2).reshape(1, steps, nh * hd), layer.o_weight, layer.o_bias)
            h = self._rms_norm(x, layer.post_norm)
            gate, up = F.linear(h, layer.gate_up_weight, layer.gate_up_bias).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down_weight, layer.down_bias)
        self._length = end
        if num_logits == 0:
            return x.new_empty(1, 0, self.vocab_size)
        if num_logits is not None:
            x = x[:, -num_logits:]
        return F.linear(self._rms_norm(x, self.final_norm), self.lm_head)
