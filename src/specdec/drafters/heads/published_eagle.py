"""Published EAGLE heads (the layouts vLLM and SGLang load), run by specdec with their own KV pool.

**EAGLE-3** (``architectures: ["LlamaForCausalLMEagle3"]``; SafeAILab's EAGLE-3 and SpecForge heads):
``fc`` ``[H, 3 * H_t]`` fuses three of the target's hidden states (side by side, in layer order) into the
feature ``f``; one decoder layer (``midlayer.*``, or ``layers.0.*``) whose q/k/v read
``[input_layernorm(embed(t)); hidden_norm(f)]`` (``2H`` wide) and whose residual stream starts at ``f``
(at ``hidden_norm(f)`` with ``norm_before_residual``); its own final ``norm`` and ``lm_head`` ``[V', H]``
over a draft vocabulary whose row ``i`` is the target token ``i + d2t[i]`` (``t2d`` ``[V]`` marks those
tokens; without ``d2t`` the draft vocabulary is the target's). The layer's output before the norm is the
feature of the next drafting step (vLLM's ``hidden_prenorm``). The token embedding is the head's own
``embed_tokens`` when the folder has one, else the target's.

**EAGLE-1/2** (SafeAILab's EAGLE and EAGLE-2 heads, vLLM's ``EagleLlamaForCausalLM``): the feature is the
target's final normed hidden state; ``fc`` ``[H, 2H]`` (bias optional) maps ``[embed(t); f]`` to the input of
one Llama decoder layer (``layers.0.*``) that has no input norm; the layer's output (no final norm) is the
next feature and the target's own ``lm_head`` scores it.

In both, entry ``j`` of a slot holds the layer's key and value for the pair ``(f_j, t_{j+1})`` at position
``j``, as for specdec's own eagle layer (:class:`~specdec.drafters.heads.eagle.EagleDrafter` drives both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from specdec.models.base import CausalLM, ForwardBatch, ForwardOutput, KVCache, to_device
from specdec.models.cpu_linear import linear, pack

EAGLE3 = "eagle3"
EAGLE1 = "eagle1"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: statistics in at least float32, then the weight in the model dtype."""
    wide = x if x.dtype == torch.float64 else x.float()
    return weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class PublishedEagle(nn.Module):
    """The weights of a published EAGLE head (``kind`` :data:`EAGLE3` or :data:`EAGLE1`), by their
    published names without the layer prefix (``self_attn.q_proj.weight``, ``fc.weight``, ``norm.weight``,
    ``lm_head.weight``, ...), and ``draft_ids`` ``[V']``: the target token of each row of the head's own
    ``lm_head`` (EAGLE-3; None for EAGLE-1, which scores with the target's head, or for a draft vocabulary
    that is the target's). ``trainable``: the weights take gradients (``specdec train eagle --format eagle3``);
    else the matrices are packed for a CPU's products where that pays (:func:`~specdec.models.cpu_linear.pack`),
    and only :meth:`linear` reads them."""

    def __init__(self, kind: str, config: LlamaConfig, tensors: dict[str, torch.Tensor],
                 draft_ids: torch.Tensor | None, trainable: bool = False) -> None:
        super().__init__()
        self.kind, self.config = kind, config
        self.weights = nn.ParameterDict({k.replace(".", "/"): nn.Parameter(v, requires_grad=trainable)
                                         for k, v in tensors.items() if trainable or v.dim() != 2})
        self.matrices = {} if trainable else {k: pack(v) for k, v in tensors.items() if v.dim() == 2}
        self.register_buffer("draft_ids", draft_ids)

    def get(self, name: str) -> torch.Tensor | None:
        """The tensor ``name`` (a published name), or None when the folder has none (a matrix of an inference
        head: :meth:`linear` reads it)."""
        return self.weights.get(name.replace(".", "/"))

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``x`` ``[..., in]`` through the matrix ``name`` (``fc``, ``self_attn.q_proj``, ...) and its bias."""
        weight = self.matrices.get(f"{name}.weight")
        return linear(x, self.get(f"{name}.weight") if weight is None else weight, self.get(f"{name}.bias"))

    def fused(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The feature ``[..., H]`` of the target's hidden states: EAGLE-3's ``fc`` over the three layers
        ``[..., 3 * H_t]``; EAGLE-1's feature is the target's final normed state itself."""
        return self.linear(target_hidden, "fc") if self.kind == EAGLE3 else target_hidden

    def inputs(self, features: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """The layer's input from features and next-token embeddings ``[..., H]``: EAGLE-3 ``[e; f]``
        ``[..., 2H]`` (the layer norms each half); EAGLE-1 ``fc([e; f])`` ``[..., H]``."""
        both = torch.cat([embeddings, features], dim=-1)
        return both if self.kind == EAGLE3 else self.linear(both, "fc")

    def attention_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What q/k/v read, and the residual stream, from the layer input ``x`` (see :meth:`inputs`)."""
        if self.kind != EAGLE3:
            return x, x
        eps, hidden = self.config.rms_norm_eps, self.config.hidden_size
        embeds, features = x[..., :hidden], x[..., hidden:]
        normed = rms_norm(features, self.get("hidden_norm.weight"), eps)
        residual = normed if getattr(self.config, "norm_before_residual", False) else features
        return torch.cat([rms_norm(embeds, self.get("input_layernorm.weight"), eps), normed], dim=-1), residual

    def qkv(self, attn_in: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``[R, heads, T, d]`` and keys and values ``[R, kv_heads, T, d]`` of ``attn_in`` ``[R, T, D]``,
        rotated by ``cos``/``sin`` ``[R, T, d]`` (transformers' rotary embedding of the positions)."""
        rows, width = attn_in.shape[:2]
        heads = self.config.num_attention_heads
        kv = getattr(self.config, "num_key_value_heads", None) or heads
        q = self.linear(attn_in, "self_attn.q_proj").view(rows, width, heads, -1).transpose(1, 2)
        k = self.linear(attn_in, "self_attn.k_proj").view(rows, width, kv, -1).transpose(1, 2)
        v = self.linear(attn_in, "self_attn.v_proj").view(rows, width, kv, -1).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def finish(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output ``[R, T, H]``: the residual plus ``o_proj`` of the attention ``[R, heads, T, d]``, then
        ``x + down(silu(gate(n)) * up(n))`` with ``n = post_attention_layernorm(x)``."""
        x = residual + self.linear(attn.transpose(1, 2).reshape(*residual.shape[:2], -1), "self_attn.o_proj")
        n = rms_norm(x, self.get("post_attention_layernorm.weight"), self.config.rms_norm_eps)
        return x + self.linear(F.silu(self.linear(n, "mlp.gate_proj")) * self.linear(n, "mlp.up_proj"),
                               "mlp.down_proj")

    def logits(self, out: torch.Tensor, target_head: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
        """Logits ``[M, V]`` of the layer's outputs ``[M, H]``: EAGLE-3 scores ``norm(out)`` with its own head
        and places row ``i`` at target token ``draft_ids[i]`` (``-inf`` elsewhere); EAGLE-1 scores ``out`` with
        the target's head."""
        if self.kind != EAGLE3:
            return linear(out, target_head)
        draft = self.linear(rms_norm(out, self.get("norm.weight"), self.config.rms_norm_eps), "lm_head")
        if self.draft_ids is None:
            return draft
        full = draft.new_full((draft.shape[0], vocab_size), float("-inf"))
        full[:, self.draft_ids] = draft
        return full


@dataclass
class LayerPool(KVCache):
    """Keys and values of the one layer, ``[num_slots, kv_heads, capacity, head_dim]``."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None


class PublishedEagleLM(CausalLM):
    """The layer of a :class:`PublishedEagle` as a backend over its own :class:`LayerPool`: a batch's
    ``input_hidden`` ``[N, D]`` (:meth:`PublishedEagle.inputs`) in, logits ``[M, V]`` and the next
    feature (the layer's output before any norm) ``[M, 1, H]`` out. Chains and tree masks, ragged rows
    (padded to the longest; eager torch, no graphs). ``target_head``: the target's output head ``[V, H]``
    (its packed copy on a CPU), which EAGLE-1 scores with."""

    supports_tree_mask = True

    def __init__(self, module: PublishedEagle, target_head: torch.Tensor, name: str) -> None:
        config = module.config
        self.module, self.target_head, self.name, self.config = module, target_head, name, config
        self.device, self.dtype = target_head.device, target_head.dtype
        self.vocab_size = int(target_head.shape[0])
        self.num_layers = 1
        self.max_length = 1 << 62  # rotary angles are computed per position: the layer sets no limit of its own
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.rotary = LlamaRotaryEmbedding(config).to(self.device)

    def new_cache(self, num_slots: int, capacity: int) -> LayerPool:
        shape = (num_slots, self.num_kv_heads, capacity, self.head_dim)
        return LayerPool(num_slots, capacity, keys=torch.zeros(shape, device=self.device, dtype=self.dtype),
                         values=torch.zeros(shape, device=self.device, dtype=self.dtype))

    def _mask(self, batch: ForwardBatch, starts: torch.Tensor, counts: torch.Tensor, cell: torch.Tensor,
              width: int, key_len: int) -> torch.Tensor:
        """``[R, 1, T, K]``: each query sees the committed entries and the new ones its chain or tree allows
        (padding queries see entry 0 only, so that no row of the softmax is empty)."""
        rows = starts.shape[0]
        rel = torch.arange(key_len, device=self.device)[None, None, :] - starts[:, None, None]  # [R, 1, K]
        query = torch.arange(width, device=self.device)[None, :, None]
        if batch.tree_mask is None:
            new = (rel >= 0) & (rel <= query)
        else:
            tree = torch.zeros(rows * width, width, dtype=torch.bool, device=self.device)
            tree[cell] = batch.tree_mask[:, :width].bool()
            bits = tree.view(rows, width, width).gather(2, rel.clamp(0, width - 1).expand(rows, width, key_len))
            new = (rel >= 0) & (rel < counts[:, None, None]) & bits
        padding = query >= counts[:, None, None]
        first = torch.arange(key_len, device=self.device)[None, None, :] == 0
        return ((rel < 0) | new | (padding & first))[:, None]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: LayerPool) -> ForwardOutput:
        self.check_fits(batch, cache)
        counts, slots = batch.num_tokens, batch.slots
        starts = [cache.lengths[s] for s in slots]
        rows, width = len(counts), max(counts)
        cells = [b * width + t for b, c in enumerate(counts) for t in range(c)]
        host = to_device([cells, [slots[b] for b, c in enumerate(counts) for _ in range(c)],
                          [starts[b] + t for b, c in enumerate(counts) for t in range(c)]], self.device)
        cell, write_slot, write_index = host[0], host[1], host[2]
        small = to_device([starts, counts, list(slots)], self.device)
        x = batch.input_hidden
        x = x.new_zeros(rows * width, x.shape[-1]).index_copy_(0, cell, x).view(rows, width, -1)
        positions = batch.positions.new_zeros(rows * width).index_copy_(0, cell, batch.positions).view(rows, width)
        m = self.module
        attn_in, residual = m.attention_input(x)
        q, k, v = m.qkv(attn_in, *self.rotary(x, positions))
        for pool, new in ((cache.keys, k), (cache.values, v)):
            pool[write_slot, :, write_index] = new.transpose(1, 2).reshape(rows * width, *new.shape[1::2])[cell]
        key_len = max(s + c for s, c in zip(starts, counts))
        keys, values = cache.keys[small[2], :, :key_len], cache.values[small[2], :, :key_len]
        mask = self._mask(batch, small[0], small[1], cell, width, key_len)
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.head_dim**-0.5,
                                              enable_gqa=self.num_kv_heads != self.num_heads)
        out = m.finish(residual, attn).reshape(rows * width, -1)[cell]
        for slot, count in zip(slots, counts):
            cache.lengths[slot] += count
        if batch.logits_rows is not None:
            out = out[batch.logits_rows]
        return ForwardOutput(m.logits(out, self.target_head, self.vocab_size), out[:, None])
