"""The model families of the fast backend: a small spec per family, read from the transformers config.

One decoder (:mod:`.fast_llama`) runs every family; what differs between them is data:

- :class:`WeightMap`: where a layer's weights are, by role, relative to ``model.layers.{i}``. A role
  may be fused in the checkpoint (Phi-3's ``qkv_proj`` and ``gate_up_proj``) or split (Llama's
  ``q_proj``/``k_proj``/``v_proj``); the decoder concatenates split ones once at load.
- :class:`Family`: the arithmetic switches a model type fixes (norm with ``1 + w``, sandwich norms,
  q/k norms, scaled embeddings, per-layer windows from ``layer_types``, rotary bases per layer type,
  the router of a mixture of experts).
- :class:`DecoderSpec`: the family and the numbers one config sets (heads, scale, soft-caps, the
  window of every layer, the activation), built by :func:`decoder_spec`.

:func:`unsupported_reason` names what a config needs that the fast backend does not do; such a
model runs on the transformers fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

LLAMA_NORMS = ("input_layernorm", None, "post_attention_layernorm", None)
"""(before attention, after attention, before the MLP, after the MLP): Llama names its pre-MLP norm
``post_attention_layernorm``."""
SANDWICH_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm")
"""Gemma 2/3: a norm before and after both the attention and the MLP."""
SPLIT_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
SPLIT_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")

ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh")
"""MLP activations the decoder computes exactly as transformers' ``ACT2FN`` does."""

WINDOW_LAYER_TYPES = {"full_attention": False, "sliding_attention": True}
"""``config.layer_types`` entries: whether the layer attends through the sliding window."""


@dataclass(frozen=True)
class WeightMap:
    """Module names, relative to ``model.layers.{i}``, of one layer's weights by role.

    ``qkv``: one fused projection ``[(heads + 2 kv_heads) * head_dim, H]`` or the q, k and v
    projections; ``gate_up``: one fused ``[2 I, H]`` or gate and up; ``norms``: before attention,
    after attention (or None), before the MLP, after the MLP (or None); ``q_norm``/``k_norm``: the
    per-head norms (or None); ``router``/``experts``: a layer whose ``mlp`` has these children is a
    mixture of experts (router ``[E, H]``; experts ``gate_up_proj`` ``[E, 2 I, H]`` and ``down_proj``
    ``[E, H, I]``), else it is dense.
    """

    qkv: tuple[str, ...] = SPLIT_QKV
    o: str = "self_attn.o_proj"
    gate_up: tuple[str, ...] = SPLIT_GATE_UP
    down: str = "mlp.down_proj"
    norms: tuple[str | None, ...] = LLAMA_NORMS
    q_norm: str | None = None
    k_norm: str | None = None
    router: str | None = None
    experts: str | None = None


QK_NORMS = {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
MOE = {"router": "mlp.gate", "experts": "mlp.experts"}


@dataclass(frozen=True)
class Family:
    """The switches one model type fixes (see the module docstring).

    ``norm_offset``: RMSNorm scales by ``1 + w`` in float32, then casts (Gemma); else ``w`` times the
    normalised input cast to the model dtype (Llama). ``embed_scale``: embeddings times
    ``sqrt(hidden)`` rounded to float32, then to the model dtype. ``layer_types``: the window of a
    layer follows ``config.layer_types`` (else every layer uses ``config.sliding_window``).
    ``rope_per_layer_type``: the rotary module takes the layer type (Gemma 3: local and global
    bases). ``activation_field``: the config field naming the MLP activation. ``router``: None
    (dense), ``"qwen3_moe"`` (softmax in float32, top-k, renormalised if ``norm_topk_prob``, then
    cast to the model dtype) or ``"mixtral"`` (softmax in float32, top-k, always renormalised, the
    expert outputs weighted in float32).
    """

    weights: WeightMap = WeightMap()
    norm_offset: bool = False
    embed_scale: bool = False
    layer_types: bool = False
    rope_per_layer_type: bool = False
    activation_field: str = "hidden_act"
    router: str | None = None


GEMMA = {"norm_offset": True, "embed_scale": True, "layer_types": True, "activation_field": "hidden_activation"}

FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(layer_types=True),
    "qwen3": Family(WeightMap(**QK_NORMS), layer_types=True),
    "phi3": Family(WeightMap(qkv=("self_attn.qkv_proj",), gate_up=("mlp.gate_up_proj",))),
    "gemma2": Family(WeightMap(norms=SANDWICH_NORMS), **GEMMA),
    "gemma3_text": Family(WeightMap(norms=SANDWICH_NORMS, **QK_NORMS), rope_per_layer_type=True, **GEMMA),
    "qwen3_moe": Family(WeightMap(**QK_NORMS, **MOE), router="qwen3_moe"),
    "mixtral": Family(WeightMap(**MOE), router="mixtral"),
}
"""Every model type the fast backend runs (``config.model_type``)."""

FAST_BACKEND = f"the fast backend (model types {', '.join(FAMILIES)})"
"""How an error names the fast backend where a feature needs it."""


@dataclass(frozen=True)
class DecoderSpec:
    """A family plus the numbers of one config.

    ``scale``: the attention score scale (``head_dim ** -0.5``, or ``query_pre_attn_scalar ** -0.5``);
    ``attn_softcap``/``final_softcap``: ``c * tanh(x / c)`` on attention scores / output logits, or None;
    ``windows``: per layer, the sliding window (a query at position ``p`` sees keys at positions
    ``p - window + 1 .. p``) or None (global); ``rope_types``: per layer, the argument of a rotary
    module that takes the layer type (None when it takes none); ``rotary_dim``: the leading dims of a
    head that rotate (Phi's ``partial_rotary_factor``); ``top_k``/``norm_topk``: the router's.
    """

    family: Family
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float
    attn_softcap: float | None
    final_softcap: float | None
    windows: tuple[int | None, ...]
    rope_types: tuple[str | None, ...]
    rotary_dim: int
    activation: str
    top_k: int = 0
    norm_topk: bool = False
    float32_route_weights: bool = False


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rope_parameters(config) -> list[dict]:
    """The rotary parameters of a config (one dict per layer type for Gemma 3)."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope and all(isinstance(value, dict) for value in rope.values()):
        return list(rope.values())
    return [rope]


def _windows(config, family: Family) -> tuple[int | None, ...]:
    window = getattr(config, "sliding_window", None)
    layers = config.num_hidden_layers
    if not family.layer_types:
        return (window,) * layers
    types = getattr(config, "layer_types", None) or ["full_attention"] * layers
    return tuple(window if WINDOW_LAYER_TYPES[t] else None for t in types)


def unsupported_reason(config) -> str | None:
    """Why the fast backend cannot run this config (one phrase naming what it needs), or None if it can."""
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        return f"model type {model_type!r} is not one of the fast backend's families ({', '.join(FAMILIES)})"
    activation = getattr(config, family.activation_field, "silu")
    if activation not in ACTIVATIONS:
        return f"activation {activation!r} is not one of {ACTIVATIONS}"
    if family.layer_types:
        unknown = sorted(set(getattr(config, "layer_types", None) or ()) - set(WINDOW_LAYER_TYPES))
        if unknown:
            return f"layer types {unknown} are not full or sliding attention"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention is not causal"
    for rope in _rope_parameters(config):
        rope_type = rope.get("rope_type", "default")
        if rope_type == "dynamic":
            return "rope type 'dynamic' rescales the frequencies with the sequence length"
        if rope_type == "longrope" and rope.get("short_factor") != rope.get("long_factor"):
            return ("rope type 'longrope' with different short and long factors switches frequencies with the "
                    "sequence length")
    if family.router and getattr(config, "num_experts_per_tok", 0) < 1:
        return "a mixture of experts with no expert per token"
    return None


def decoder_spec(config) -> DecoderSpec:
    """The spec of a config that :func:`unsupported_reason` accepts."""
    family = FAMILIES[config.model_type]
    heads = config.num_attention_heads
    head_dim = _head_dim(config)
    scalar = getattr(config, "query_pre_attn_scalar", None)
    rope = _rope_parameters(config)[0]
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    layers = config.num_hidden_layers
    types = tuple(getattr(config, "layer_types", None) or ()) if family.rope_per_layer_type else (None,) * layers
    return DecoderSpec(
        family=family,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        eps=config.rms_norm_eps,
        scale=(scalar if scalar else head_dim) ** -0.5,
        attn_softcap=getattr(config, "attn_logit_softcapping", None),
        final_softcap=getattr(config, "final_logit_softcapping", None),
        windows=_windows(config, family),
        rope_types=types,
        rotary_dim=rotary_dim,
        activation=getattr(config, family.activation_field, "silu"),
        top_k=getattr(config, "num_experts_per_tok", 0) if family.router else 0,
        norm_topk=family.router == "mixtral" or bool(getattr(config, "norm_topk_prob", False)),
        float32_route_weights=family.router == "mixtral",
    )
