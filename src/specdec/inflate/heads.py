"""Inflating head folders (eagle, medusa, mtp, the early-exit adapter; :mod:`specdec.drafters.heads`)
along with their target, so that they read the inflated target's features and load on it.

The target's features (its final normed state, and the layer outputs eagle fuses or the early exit
reads) are the source's, zero-padded (:mod:`specdec.inflate.layout`), so each head is inflated the
same way: its input and output widths are zero-padded, its norms scaled (weights by ``sqrt(d / D)``,
``rms_norm_eps`` by ``d / D``), eagle's decoder layer gets the inflated target's head layout, and
every MLP inside a head grows by the target's MLP ratio (added units have zero weights). Layer
indices (eagle's ``feature_layers``, the early exit's ``exit_layer``) are mapped to where those
layers are in the inflated target (:meth:`~specdec.inflate.layout.Layout.hidden_index`). The
folder's spec carries the inflated target's name and output-head fingerprint.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdec.drafters.draft_vocab import TOKEN_COUNTS_FILE
from specdec.drafters.heads.common import EARLY_EXIT, WEIGHTS_FILE, HeadSpec, fingerprint
from specdec.errors import SpecDecError
from specdec.inflate.layout import AxisMap, Dims, Layout, place
from specdec.inflate.model import LAYER_AXES, inflate_layer
from specdec.tensor_files import save_tensors

_DECODER_LAYER = "decoder.model.layers.0."


def _eagle_layout(spec: HeadSpec, target: Layout, intermediate: int) -> Layout:
    """The layout of eagle's decoder layer: the source layer's heads into the inflated target's."""
    heads = spec.layer.get("num_attention_heads") or 1
    head_dim = spec.layer.get("head_dim") or spec.hidden_size // heads
    src = Dims(spec.hidden_size, 1, heads, spec.layer.get("num_key_value_heads") or heads, head_dim,
               spec.intermediate_size)
    dst = Dims(target.dst.hidden, 1, target.dst.heads, target.dst.kv_heads, head_dim, intermediate)
    return Layout(src, dst, "the inflated eagle layer")


def inflate_head_state(spec: HeadSpec, state: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """The weights of a head folder of ``spec`` inflated along the target's ``layout``."""
    d = spec.hidden_size
    hidden = layout.hidden
    mlp = AxisMap.prefix(spec.intermediate_size, layout.widen(spec.intermediate_size))
    pair = AxisMap.cat([hidden, hidden], [d, d])
    out: dict[str, torch.Tensor] = {}
    layer: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        last = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]
        if name.startswith(_DECODER_LAYER):
            layer[name.removeprefix(_DECODER_LAYER)] = tensor
        elif last.startswith("norm"):  # eagle's decoder norm, mtp's four norms, the adapter's norm
            out[name] = place(tensor, (hidden,), layout.norm_scale)
        elif name == "fc.weight" or re.fullmatch(r"depths\.\d+\.proj\.weight", name):  # [H, 2H]
            out[name] = place(tensor, (hidden, pair))
        elif name == "fuse.weight":  # [H, F * H]
            parts = tensor.shape[1] // d
            out[name] = place(tensor, (hidden, AxisMap.cat([hidden] * parts, [d] * parts)))
        elif re.fullmatch(r"blocks\.\d+\.weight", name):  # medusa [H, H]
            out[name] = place(tensor, (hidden, hidden))
        elif re.fullmatch(r"blocks\.\d+\.bias", name):
            out[name] = place(tensor, (hidden,))
        elif last == "gate_up":  # [2I, H]: gate rows, then up rows
            out[name] = place(tensor, (AxisMap.cat([mlp, mlp], [spec.intermediate_size] * 2), hidden))
        elif last == "down":  # [H, I]
            out[name] = place(tensor, (hidden, mlp))
        else:
            raise SpecDecError(f"cannot inflate the head tensor {name!r} of a {spec.method} folder")
    if layer:
        if set(layer) - set(LAYER_AXES):
            raise SpecDecError(f"cannot inflate eagle layer tensors {sorted(set(layer) - set(LAYER_AXES))}")
        eagle = _eagle_layout(spec, layout, layout.widen(spec.intermediate_size))
        out.update({_DECODER_LAYER + s: t for s, t in inflate_layer(eagle, layer).items()})
    return out


def inflate_spec(spec: HeadSpec, layout: Layout, lm_head: torch.Tensor, target_name: str) -> HeadSpec:
    """``spec`` for the inflated target (``lm_head`` ``[V, D]``, for its fingerprint)."""
    layer = dict(spec.layer)
    if layer:
        layer.update(num_attention_heads=layout.dst.heads, num_key_value_heads=layout.dst.kv_heads,
                     head_dim=layout.dst.head_dim)
    exit_layer = layout.hidden_index(spec.exit_layer) if spec.method == EARLY_EXIT else spec.exit_layer
    return dataclasses.replace(
        spec, target_name=target_name, target_fingerprint=fingerprint(lm_head), hidden_size=layout.dst.hidden,
        intermediate_size=layout.widen(spec.intermediate_size), rms_norm_eps=spec.rms_norm_eps * layout.eps_scale,
        exit_layer=exit_layer, layer=layer, feature_layers=[layout.hidden_index(i) for i in spec.feature_layers])


def inflate_heads(source: str | os.PathLike[str], dest: str | os.PathLike[str], layout: Layout,
                  lm_head: torch.Tensor, target_name: str) -> HeadSpec:
    """Inflate the head folder ``source`` (trained for the source target) into ``dest`` for the target
    inflated along ``layout``, whose output head is ``lm_head`` ``[V, D]`` and name ``target_name``;
    the token counts of its draft vocabulary are copied (the vocabulary is unchanged)."""
    src, out = Path(source), Path(dest)
    spec = HeadSpec.load(src)
    if spec.hidden_size != layout.src.hidden:
        raise SpecDecError(f"the heads in {str(src)!r} are {spec.hidden_size} wide, their target "
                           f"{layout.src.hidden}")
    state = load_file(str(src / WEIGHTS_FILE))
    new_state = inflate_head_state(spec, state, layout)
    new_spec = inflate_spec(spec, layout, lm_head, target_name)
    out.mkdir(parents=True, exist_ok=True)
    new_spec.save_pretrained(out)
    save_tensors({n: t.contiguous() for n, t in new_state.items()}, out / WEIGHTS_FILE)
    if (src / TOKEN_COUNTS_FILE).is_file():
        shutil.copy2(src / TOKEN_COUNTS_FILE, out / TOKEN_COUNTS_FILE)
    return new_spec
