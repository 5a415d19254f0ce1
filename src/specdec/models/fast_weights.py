"""The fast backend's weights of a loaded transformers model, by role: each decoder layer's read through its
family's weight map (:mod:`.families`), split q/k/v and gate/up projections fused into one matrix each, norm
weights in the form :func:`~.layers.rms_norm` takes them. Nothing else is copied."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.models.families import DecoderSpec


@dataclass
class LayerWeights:
    """One decoder layer's weights by role, as the :mod:`.layers` functions take them: ``attention``
    the arguments of ``attention_inputs`` before ``cos``; ``output`` those of ``attention_output_and_mlp``
    (dense) or ``attention_output`` (routed) after ``attn``; ``experts`` (router, gate_up, down) or None;
    ``window`` and ``rope``: the layer's sliding window and rotary table (keys of ``FastLlamaLM.rope``)."""

    attention: tuple
    output: tuple
    experts: tuple | None
    window: int | None
    rope: str | None


def _joined(modules: list[torch.nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias of one projection, or of split projections concatenated (a bias of zeros
    for a part without one; None when no part has one)."""
    if len(modules) == 1:
        return modules[0].weight, modules[0].bias
    weight = torch.cat([m.weight for m in modules])
    if all(m.bias is None for m in modules):
        return weight, None
    return weight, torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.weight.shape[0])
                              for m in modules])


def norm_weight(weight: torch.Tensor | None, offset: bool) -> torch.Tensor | None:
    """A norm's weight as :func:`~.layers.rms_norm` takes it: ``1 + w`` in float32 with ``offset``."""
    if weight is None or not offset:
        return weight
    return 1.0 + weight.float()


def _find(module: torch.nn.Module, name: str | None) -> torch.nn.Module | None:
    """``module``'s submodule ``name``, or None when the name is None or the module has no such child
    (a mixture-of-experts model's dense layers have no experts)."""
    if name is None:
        return None
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def plain(weight: torch.Tensor) -> torch.Tensor:
    """A weight as it is (``read_layer``'s ``packed`` where nothing is packed)."""
    return weight


def read_layer(layer: torch.nn.Module, spec: DecoderSpec, index: int,
                packed: Callable[[torch.Tensor], torch.Tensor]) -> LayerWeights:
    """A layer's weights through the family's weight map; ``packed`` turns each dense matrix of the
    layer (q/k/v, o, gate/up, down) into the form :func:`~.cpu_linear.linear` runs fastest
    (:func:`~.cpu_linear.pack`, or the weight itself). Experts and the router stay plain."""
    names, offset = spec.family.weights, spec.family.norm_offset

    def get(name: str | None) -> torch.nn.Module | None:
        return None if name is None else layer.get_submodule(name)

    def norm(name: str | None) -> torch.Tensor | None:
        return None if name is None else norm_weight(get(name).weight, offset)

    qkv_weight, qkv_bias = _joined([get(n) for n in names.qkv])
    qkv_weight = packed(qkv_weight)
    qk_norm = None
    if names.q_norm is not None:  # one weight row per head: [heads + kv_heads, 1, head_dim]
        q, k = get(names.q_norm).weight, get(names.k_norm).weight
        qk_norm = norm_weight(torch.cat([q.expand(spec.num_heads, -1), k.expand(spec.num_kv_heads, -1)])[:, None],
                               offset)
    attn_norm, out_norm, mlp_norm, mlp_out_norm = (norm(n) for n in names.norms)
    o = get(names.o)
    experts = None
    bank = _find(layer, names.experts)
    if bank is not None:
        experts = (get(names.router).weight, bank.gate_up_proj, bank.down_proj)
        output = (packed(o.weight), o.bias, out_norm, mlp_norm)
    else:
        gate_up_weight, gate_up_bias = _joined([get(n) for n in names.gate_up])
        down = get(names.down)
        output = (packed(o.weight), o.bias, out_norm, mlp_norm, packed(gate_up_weight), gate_up_bias,
                  packed(down.weight), down.bias, mlp_out_norm)
    return LayerWeights((attn_norm, qkv_weight, qkv_bias, qk_norm), output, experts, spec.windows[index],
                  spec.rope_types[index])
