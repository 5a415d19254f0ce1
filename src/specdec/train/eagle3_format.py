"""``specdec train eagle --format eagle3``: an EAGLE-3 head trained here and written in the published layout
that vLLM and SGLang load (``LlamaForCausalLMEagle3``), which specdec loads too
(:mod:`specdec.drafters.heads.published`).

The head is :class:`~specdec.drafters.heads.published_eagle.PublishedEagle` with trainable weights: ``fc`` over
three of the target's hidden states (vLLM's default layers ``(2, L // 2, L - 3)``, or ``--feature-layers``), the
``midlayer`` on ``[input_layernorm(embed(t)); hidden_norm(f)]``, its ``norm`` and an ``lm_head`` over the
target's whole vocabulary (initialised from the target's head; ``d2t`` all zeros and ``t2d`` all true, the
identity maps both servers read). Its token embedding is the target's (not saved, as in the published heads).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from specdec.drafters.heads.common import CONFIG_FILE, WEIGHTS_FILE, HeadSpec
from specdec.drafters.heads.published import EAGLE3_ARCHITECTURE
from specdec.drafters.heads.published_eagle import EAGLE3, PublishedEagle
from specdec.tensor_files import save_tensors

FORMATS = ("specdec", "eagle3")
"""``specdec train eagle --format``: specdec's own head folder, or the published EAGLE-3 layout."""


def head_config(spec: HeadSpec) -> LlamaConfig:
    """The one-layer Llama config of an EAGLE-3 head of ``spec`` (the target's attention shape and rope)."""
    layer = {k: v for k, v in spec.layer.items() if v is not None}
    return LlamaConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                       intermediate_size=spec.intermediate_size, num_hidden_layers=1,
                       rms_norm_eps=spec.rms_norm_eps, **layer)


class Eagle3Training(nn.Module):
    """A trainable EAGLE-3 head over a frozen target's embedding ``[V, H]`` and head ``[V, H]``; ``config`` is its
    :class:`HeadSpec` (what the training loop's checkpoints write)."""

    def __init__(self, spec: HeadSpec, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        super().__init__()
        self.config = spec
        llama = head_config(spec)
        hidden, inter = spec.hidden_size, spec.intermediate_size
        heads = llama.num_attention_heads
        kv = getattr(llama, "num_key_value_heads", None) or heads
        head_dim = hidden // heads

        def normal(*shape: int) -> torch.Tensor:
            return torch.randn(*shape) * 0.02

        tensors = {"fc.weight": normal(hidden, 3 * hidden),
                   "self_attn.q_proj.weight": normal(heads * head_dim, 2 * hidden),
                   "self_attn.k_proj.weight": normal(kv * head_dim, 2 * hidden),
                   "self_attn.v_proj.weight": normal(kv * head_dim, 2 * hidden),
                   "self_attn.o_proj.weight": normal(hidden, heads * head_dim),
                   "mlp.gate_proj.weight": normal(inter, hidden), "mlp.up_proj.weight": normal(inter, hidden),
                   "mlp.down_proj.weight": normal(hidden, inter),
                   "input_layernorm.weight": torch.ones(hidden), "hidden_norm.weight": torch.ones(hidden),
                   "post_attention_layernorm.weight": torch.ones(hidden), "norm.weight": torch.ones(hidden),
                   "lm_head.weight": lm_head.detach().float().cpu().clone()}
        tensors = {k: v.to(embed.device, embed.dtype) for k, v in tensors.items()}
        self.head = PublishedEagle(EAGLE3, llama, tensors, None, trainable=True)
        self.rotary = LlamaRotaryEmbedding(llama).to(embed.device)
        self.register_buffer("embed", embed.detach(), persistent=False)

    def fused(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """``[B, T, 3H]`` -> the features ``[B, T, H]``."""
        return self.head.fused(target_hidden)

    def forward(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced pass over pairs (``features`` ``[B, T, H]``, ``tokens`` ``[B, T]``) at positions
        ``0..T-1``: the layer's outputs before its norm, ``[B, T, H]`` (the next features)."""
        x = self.head.inputs(features, F.embedding(tokens, self.embed))
        attn_in, residual = self.head.attention_input(x)
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
        q, k, v = self.head.qkv(attn_in, *self.rotary(x, positions))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return self.head.finish(residual, attn)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """``[B, T, H]`` -> ``[B, T, V]``: the head's norm and output head."""
        shape = out.shape
        return self.head.logits(out.reshape(-1, shape[-1]), None, self.config.vocab_size).view(*shape[:-1], -1)


def save_eagle3(module: Eagle3Training, folder: Path, dtype: torch.dtype) -> None:
    """Write ``module`` into ``folder`` in the published EAGLE-3 layout: ``config.json`` (the Llama fields,
    ``LlamaForCausalLMEagle3``, ``draft_vocab_size``, the target layers for vLLM at the top level and for
    SGLang in ``eagle_config`` when it can name them) and ``model.safetensors`` (``fc``, ``midlayer.*``,
    ``norm``, ``lm_head``, ``d2t``, ``t2d``)."""
    spec, llama = module.config, module.head.config
    layers = list(spec.feature_layers)
    config: dict[str, Any] = {
        "architectures": [EAGLE3_ARCHITECTURE], "model_type": "llama", "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": llama.num_attention_heads, "num_key_value_heads": llama.num_key_value_heads,
        "max_position_embeddings": llama.max_position_embeddings, "rms_norm_eps": spec.rms_norm_eps,
        "vocab_size": spec.vocab_size, "draft_vocab_size": spec.vocab_size, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."),
        "rope_parameters": llama.rope_parameters, "eagle_aux_hidden_state_layer_ids": layers,
    }
    rope = dict(llama.rope_parameters or {})
    if "rope_theta" in rope:  # the older field names, for servers that read those
        config["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = rope
    if min(layers) >= 1:  # SGLang names layer outputs: the input of layer i is the output of layer i - 1
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers],
                                  "use_aux_hidden_state": True}
    tensors = {}
    for key, value in module.head.weights.items():
        name = key.replace("/", ".")
        inner = name.split(".")[0] in ("self_attn", "mlp", "input_layernorm", "hidden_norm", "post_attention_layernorm")
        tensors[f"midlayer.{name}" if inner else name] = value.detach().to("cpu", dtype).contiguous()
    tensors["d2t"] = torch.zeros(spec.vocab_size, dtype=torch.long)
    tensors["t2d"] = torch.ones(spec.vocab_size, dtype=torch.bool)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    save_tensors(tensors, folder / WEIGHTS_FILE)
