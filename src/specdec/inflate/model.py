"""Function-preserving inflation of a Llama or Qwen2 checkpoint to a named shape
(:data:`specdec.shapes.SHAPES`): the weights and config of a larger model with the same logits.

The construction and why it is exact: :mod:`specdec.inflate.layout`. The vocabulary is not padded
(extra rows would score 0, which can beat real tokens), so the parameter count is the shape's layers
with the source's vocabulary: :attr:`Inflated.num_parameters`. Heads keep the source's width; a shape
whose real ``head_dim`` differs (128 for ``3b`` and ``8b``) keeps its query and KV widths and FLOPs
with more heads of the source's width (``8b``: 64 query and 16 KV heads of 64).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from specdec.errors import SpecDecError
from specdec.inflate.layout import AxisMap, Dims, Layout, place
from specdec.shapes import Shape

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
LAYER_AXES: dict[str, tuple[str, ...]] = {
    "input_layernorm.weight": ("hidden",),
    "post_attention_layernorm.weight": ("hidden",),
    "self_attn.q_proj.weight": ("q", "hidden"),
    "self_attn.q_proj.bias": ("q",),
    "self_attn.k_proj.weight": ("kv", "hidden"),
    "self_attn.k_proj.bias": ("kv",),
    "self_attn.v_proj.weight": ("kv", "hidden"),
    "self_attn.v_proj.bias": ("kv",),
    "self_attn.o_proj.weight": ("hidden", "q"),
    "self_attn.o_proj.bias": ("hidden",),
    "mlp.gate_proj.weight": ("mlp", "hidden"),
    "mlp.gate_proj.bias": ("mlp",),
    "mlp.up_proj.weight": ("mlp", "hidden"),
    "mlp.up_proj.bias": ("mlp",),
    "mlp.down_proj.weight": ("hidden", "mlp"),
    "mlp.down_proj.bias": ("hidden",),
}
"""The axes of each decoder-layer tensor (by its name after ``layers.<i>.``)."""
_LAYER = re.compile(r"^(?P<prefix>.*layers\.)(?P<index>\d+)\.(?P<suffix>.+)$")


def config_dims(config: Any) -> Dims:
    """The :class:`Dims` of a transformers Llama/Qwen2 config (or a :class:`SpecDecError` naming the
    unsupported architecture)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise SpecDecError(f"inflation supports model types {', '.join(SUPPORTED_MODEL_TYPES)}, not {model_type!r}")
    heads = config.num_attention_heads
    return Dims(config.hidden_size, config.num_hidden_layers, heads,
                getattr(config, "num_key_value_heads", None) or heads,
                getattr(config, "head_dim", None) or config.hidden_size // heads, config.intermediate_size)


def shape_dims(shape: Shape, name: str, head_dim: int) -> Dims:
    """The :class:`Dims` of ``shape`` with heads ``head_dim`` wide (its query and KV widths kept)."""
    if shape.q_width % head_dim or shape.kv_width % head_dim:
        raise SpecDecError(f"shape {name!r}: query width {shape.q_width} and KV width {shape.kv_width} are not "
                           f"multiples of the source's head_dim {head_dim}")
    return Dims(shape.hidden_size, shape.num_layers, shape.q_width // head_dim, shape.kv_width // head_dim,
                head_dim, shape.intermediate_size)


def layer_axes(layout: Layout, suffix: str) -> tuple[AxisMap, ...]:
    """The axis maps of a decoder-layer tensor named ``suffix``."""
    if suffix not in LAYER_AXES:
        raise SpecDecError(f"cannot inflate the decoder-layer tensor {suffix!r} (Llama/Qwen2 layers only)")
    maps = {"hidden": layout.hidden, "q": layout.q_heads(), "kv": layout.kv_heads(), "mlp": layout.mlp}
    return tuple(maps[kind] for kind in LAYER_AXES[suffix])


def inflate_layer(layout: Layout, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One decoder layer's tensors (by suffix) inflated: norms scaled by ``sqrt(d / D)``."""
    return {suffix: place(t, layer_axes(layout, suffix), layout.norm_scale if suffix in NORMS else 1.0)
            for suffix, t in tensors.items()}


Tensors = dict[str, torch.Tensor]


def _split_layers(state: Mapping[str, torch.Tensor]) -> tuple[Tensors, dict[int, Tensors], str]:
    """(the non-layer tensors, each layer's tensors by suffix, the layers' name prefix)."""
    others: dict[str, torch.Tensor] = {}
    layers: dict[int, dict[str, torch.Tensor]] = {}
    prefix = "model.layers."
    for name, tensor in state.items():
        if name.endswith("rotary_emb.inv_freq"):  # a buffer older checkpoints saved; recomputed from the config
            continue
        match = _LAYER.match(name)
        if match is None:
            others[name] = tensor
        else:
            prefix = match["prefix"]
            layers.setdefault(int(match["index"]), {})[match["suffix"]] = tensor
    return others, layers, prefix


def inflate_state(state: Mapping[str, torch.Tensor], layout: Layout) -> Iterator[tuple[str, torch.Tensor]]:
    """The inflated tensors of a Llama/Qwen2 ``state`` (transformers names; the output head absent when
    tied), one at a time, in the source's dtypes."""
    others, layers, prefix = _split_layers(state)
    if sorted(layers) != list(range(layout.src.layers)):
        raise SpecDecError(f"the checkpoint holds layers {sorted(layers)}, not the {layout.src.layers} of its config")
    hidden = layout.hidden
    for name, tensor in others.items():
        if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            yield name, place(tensor, (AxisMap.prefix(tensor.shape[0], tensor.shape[0]), hidden))
        elif name.endswith("norm.weight"):
            yield name, place(tensor, (hidden,), layout.norm_scale)
        else:
            raise SpecDecError(f"cannot inflate the tensor {name!r} (Llama/Qwen2 checkpoints only)")
    source_of = {position: i for i, position in enumerate(layout.layer_at)}
    for position in range(layout.dst.layers):
        if position in source_of:
            tensors = inflate_layer(layout, layers[source_of[position]])
        else:  # an added layer: all zero, so it adds exactly zero to the residual stream
            tensors = {s: torch.zeros([a.size for a in layer_axes(layout, s)], dtype=t.dtype)
                       for s, t in layers[0].items()}
        for suffix, tensor in tensors.items():
            yield f"{prefix}{position}.{suffix}", tensor


def inflate_config(config: Any, layout: Layout) -> Any:
    """A copy of the transformers ``config`` with the inflated widths, ``rms_norm_eps`` times ``d / D``
    and per-layer fields (``layer_types``) mapped to the inflated layers (added layers: full attention)."""
    dst = layout.dst
    new = config.__class__.from_dict(config.to_dict())
    new.hidden_size, new.intermediate_size, new.num_hidden_layers = dst.hidden, dst.intermediate, dst.layers
    new.num_attention_heads, new.num_key_value_heads, new.head_dim = dst.heads, dst.kv_heads, dst.head_dim
    new.rms_norm_eps = config.rms_norm_eps * layout.eps_scale
    types = getattr(config, "layer_types", None)
    if types is not None:
        mapped = ["full_attention"] * dst.layers
        for i, position in enumerate(layout.layer_at):
            mapped[position] = types[i]
        new.layer_types = mapped
    if getattr(config, "max_window_layers", None) is not None:  # Qwen2: the first layers, mapped
        kept = min(config.max_window_layers, config.num_hidden_layers)
        new.max_window_layers = layout.layer_at[kept - 1] + 1 if kept else 0
    return new


@dataclass
class Inflated:
    """An inflated checkpoint in memory: ``state`` (transformers names), ``config`` and the ``layout``."""

    state: dict[str, torch.Tensor]
    config: Any
    layout: Layout

    @property
    def num_parameters(self) -> int:
        """Parameters, a tied output head counted once."""
        return sum(t.numel() for t in self.state.values())

    @property
    def lm_head(self) -> torch.Tensor:
        """The output head ``[V, D]`` (the embedding when tied)."""
        if "lm_head.weight" in self.state:
            return self.state["lm_head.weight"]
        return next(t for n, t in self.state.items() if n.endswith("embed_tokens.weight"))


def layout_for(config: Any, shape: Shape, name: str) -> Layout:
    """The :class:`Layout` from a Llama/Qwen2 ``config`` to the shape ``name``."""
    src = config_dims(config)
    return Layout(src, shape_dims(shape, name, src.head_dim), f"shape {name!r}")


def inflate_weights(state: Mapping[str, torch.Tensor], config: Any, shape: Shape, name: str) -> Inflated:
    """``state`` and ``config`` of a Llama/Qwen2 checkpoint inflated to ``shape`` (called ``name``). A tied
    model's ``lm_head.weight`` in ``state`` is dropped (it is the embedding)."""
    layout = layout_for(config, shape, name)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    source = {n: t for n, t in state.items() if not (tied and n == "lm_head.weight")}
    return Inflated(dict(inflate_state(source, layout)), inflate_config(config, layout), layout)


def inflate_model(model: Any, shape: Shape, name: str) -> Any:
    """A loaded transformers Llama/Qwen2 model inflated to ``shape``: a new model of the same class, dtype
    and device, in eval mode, whose logits equal ``model``'s up to rounding (``[B, T, V]`` for any input)."""
    from transformers.initialization import no_init_weights

    inflated = inflate_weights({n: t.detach().cpu() for n, t in model.state_dict().items()}, model.config, shape, name)
    param = next(model.parameters())
    with no_init_weights():
        new = model.__class__(inflated.config)
    new.load_state_dict(inflated.state, strict=False)
    new.tie_weights()
    missing = {n for n, _ in new.named_parameters()} - set(inflated.state) - {"lm_head.weight"}
    if missing:
        raise SpecDecError(f"inflation left parameters unset: {sorted(missing)[:3]}")
    return new.to(device=param.device, dtype=param.dtype).eval()
