"""Head folders in the layouts vLLM and SGLang load (published heads), read and checked against the target.

A folder is *published* when its ``config.json`` is not a specdec :class:`~.common.HeadSpec` (it has no
``target_fingerprint``). Its weights are ``*.safetensors`` (or, failing those, ``*.bin``/``*.pt`` pickles
read with ``weights_only``). Published heads carry no fingerprint of their target, so compatibility is
checked by shapes: every tensor's shape against the config and the target (hidden size, vocabulary), a
complete set of tensors with no unknown ones, and EAGLE-3's target layers within the target's layer count.

- EAGLE-3 and EAGLE-1/2: :mod:`.published_eagle`.
- Medusa: FasterDecoding's layout (``medusa_head.{i}.{j}.linear.weight/bias`` residual blocks and
  ``medusa_head.{i}.{n}.weight`` per-head output heads, ``n = medusa_num_layers``; the legacy
  ``medusa_lm_head`` files without the ``medusa_head.`` prefix too; config ``medusa_num_heads``,
  ``medusa_num_layers``) and vLLM's (``blocks.{i}.layers.{j}.weight/bias``, ``lm_heads.{i}.weight``; config
  ``num_heads``, ``num_hidden_layers``). Head ``i`` scores ``x_n`` with ``x_0 = f`` (the target's final
  normed hidden state) and ``x_{j+1} = x_j + silu(W_ij x_j + b_ij)``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaConfig

from specdec.drafters.draft_vocab import TOKEN_COUNTS_FILE
from specdec.drafters.heads.common import CONFIG_FILE, HeadSpec
from specdec.drafters.heads.published_eagle import EAGLE1, EAGLE3, PublishedEagle
from specdec.drafters.method_of import EAGLE3_ARCHITECTURE
from specdec.errors import SpecDecError
from specdec.models.base import CausalLM
from specdec.models.cpu_linear import PackedLinear, linear, pack


def read_config(folder: Path) -> dict[str, Any]:
    try:
        data = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecDecError(f"cannot read {str(folder / CONFIG_FILE)!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise SpecDecError(f"{str(folder / CONFIG_FILE)!r} is not a JSON object")
    return data


def is_published(folder: Path) -> bool:
    """Whether ``folder`` holds heads in a published layout (not a specdec head folder)."""
    return "target_fingerprint" not in read_config(folder)


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weight files, by name (a ``model.`` prefix dropped)."""
    files = sorted(p for p in folder.glob("*.safetensors") if p.name != TOKEN_COUNTS_FILE)
    pickled = not files
    if pickled:
        files = sorted([*folder.glob("*.bin"), *folder.glob("*.pt")])
    if not files:
        raise SpecDecError(f"{str(folder)!r} has no weights (*.safetensors, *.bin or *.pt)")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            part = torch.load(path, map_location="cpu", weights_only=True) if pickled else load_file(str(path))
        except (OSError, ValueError, RuntimeError, SafetensorError, EOFError) as exc:
            raise SpecDecError(f"cannot read the head weights {str(path)!r}: {exc}") from exc
        if not isinstance(part, dict):
            raise SpecDecError(f"{str(path)!r} does not hold a dict of tensors")
        tensors.update({k.removeprefix("model."): v for k, v in part.items() if isinstance(v, torch.Tensor)})
    return tensors


def check_tensors(folder: Path, what: str, tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]],
                  ignored: tuple[str, ...] = ()) -> None:
    """Every name of ``expected`` present with its shape, and nothing else but ``ignored``, or a
    :class:`SpecDecError` that names the tensor."""
    for name, shape in expected.items():
        if name not in tensors:
            raise SpecDecError(f"the {what} in {str(folder)!r} lack the tensor {name!r}")
        if tuple(tensors[name].shape) != tuple(shape):
            raise SpecDecError(f"the {what} in {str(folder)!r}: tensor {name!r} has shape "
                               f"{tuple(tensors[name].shape)}, expected {tuple(shape)}")
    unknown = sorted(set(tensors) - set(expected) - set(ignored))
    if unknown:
        raise SpecDecError(f"the {what} in {str(folder)!r} hold tensors this layout does not have: {unknown[:5]}")


def target_shape(target: CausalLM, lm_head: torch.Tensor) -> tuple[int, int, int]:
    """The target's hidden size, vocabulary (output head rows) and decoder layer count."""
    return int(lm_head.shape[1]), int(lm_head.shape[0]), int(target.num_layers)


def _int(config: dict[str, Any], key: str, folder: Path, default: Any = None) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise SpecDecError(f"{str(folder / CONFIG_FILE)!r}: {key!r} must be a positive integer, got {value!r}")
    return value


def aux_layer_ids(config: dict[str, Any], num_layers: int, folder: Path) -> list[int]:
    """EAGLE-3's target layers as indices into transformers' ``hidden_states`` (``i``: the input of decoder
    layer ``i``), in layer order. vLLM reads a top-level ``eagle_aux_hidden_state_layer_ids`` in that
    convention; SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` as layer outputs (index + 1);
    both default to ``(2, L // 2, L - 3)`` for a target of ``L`` layers. A config with both fields naming
    different layers is refused: the two servers would run the head on different features."""
    nested = config.get("eagle_config") or {}
    if not isinstance(nested, dict):
        raise SpecDecError(f"{str(folder / CONFIG_FILE)!r}: 'eagle_config' must be an object")
    if nested.get("eagle_aux_hidden_state_layer_ids"):
        ids, offset = nested["eagle_aux_hidden_state_layer_ids"], 1
        where = "eagle_config.eagle_aux_hidden_state_layer_ids"
    elif config.get("eagle_aux_hidden_state_layer_ids"):
        ids, where, offset = config["eagle_aux_hidden_state_layer_ids"], "eagle_aux_hidden_state_layer_ids", 0
    else:
        ids, where, offset = [2, num_layers // 2, num_layers - 3], "the default (2, L // 2, L - 3)", 0
    if not isinstance(ids, list) or len(ids) != 3 or any(not isinstance(i, int) or isinstance(i, bool) for i in ids):
        raise SpecDecError(f"{str(folder)!r}: {where} must be a list of three layer ids, got {ids!r}")
    resolved = sorted(i + offset for i in ids)
    top = config.get("eagle_aux_hidden_state_layer_ids")
    if offset == 1 and top and (not isinstance(top, list) or sorted(top) != resolved):
        raise SpecDecError(
            f"the EAGLE-3 head in {str(folder)!r} names its target layers twice, differently: "
            f"eagle_config.eagle_aux_hidden_state_layer_ids {ids} (SGLang's convention, layer outputs: hidden "
            f"states {resolved}) and eagle_aux_hidden_state_layer_ids {top!r} (vLLM's, layer inputs); vLLM and "
            f"SGLang would run it on different layers. Keep the field of the layers it was trained on")
    if any(not 0 <= i < num_layers for i in resolved) or len(set(resolved)) != 3:
        raise SpecDecError(f"the EAGLE-3 head in {str(folder)!r} reads target layers {ids} ({where}), which are not "
                           f"three distinct layers of a target with {num_layers} layers (name three in "
                           "eagle_aux_hidden_state_layer_ids, or train with --feature-layers I,J,K)")
    return resolved


def _layer_shapes(config: LlamaConfig, qkv_in: int) -> dict[str, tuple[int, ...]]:
    """The decoder layer's tensors (``layers.0.`` names) and shapes, biases as the config says."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    shapes = {"self_attn.q_proj": (heads * head_dim, qkv_in), "self_attn.k_proj": (kv * head_dim, qkv_in),
              "self_attn.v_proj": (kv * head_dim, qkv_in), "self_attn.o_proj": (hidden, heads * head_dim),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    out = {f"layers.0.{k}.weight": v for k, v in shapes.items()}
    for name, bias in (("self_attn", bool(getattr(config, "attention_bias", False))),
                       ("mlp", bool(getattr(config, "mlp_bias", False)))):
        if bias:
            out.update({f"layers.0.{k}.bias": (v[0],) for k, v in shapes.items() if k.startswith(name)})
    out["layers.0.post_attention_layernorm.weight"] = (hidden,)
    return out


def load_eagle(folder: Path, target: CausalLM, lm_head: torch.Tensor, method: str,
               eagle3_only: bool) -> tuple[PublishedEagle, HeadSpec, torch.Tensor | None]:
    """A published EAGLE-3 or EAGLE-1/2 head for ``target``, checked, on the target's device and dtype; with
    its :class:`HeadSpec` and its own token embedding ``[V, H]`` (None: the target's)."""
    data = read_config(folder)
    if "transformer_layer_config" in data or "speculators_config" in data:
        raise SpecDecError(f"{str(folder)!r} is in vLLM's speculators format ({data.get('architectures')}), which "
                           "specdec does not load: use the head in its original EAGLE layout")
    nested = data.get("eagle_config")
    if isinstance(nested, dict) and nested.get("use_aux_hidden_state") is False:
        raise SpecDecError(f"the EAGLE-3 head in {str(folder)!r} sets use_aux_hidden_state false (no fc over three "
                           "target layers), which specdec does not load")
    tensors = {re.sub(r"^midlayer\.", "layers.0.", k): v for k, v in read_tensors(folder).items()}
    hidden_t, vocab, num_layers = target_shape(target, lm_head)
    eagle3 = (EAGLE3_ARCHITECTURE in (data.get("architectures") or []) or "layers.0.hidden_norm.weight" in tensors
              or "d2t" in tensors)
    if eagle3_only and not eagle3:
        raise SpecDecError(f"{str(folder)!r} is not an EAGLE-3 head (architectures {data.get('architectures')}, "
                           f"no hidden_norm): use method 'eagle' for EAGLE-1/2 heads")
    what = "EAGLE-3 head" if eagle3 else "EAGLE head"
    if data.get("num_hidden_layers", 1) != 1:
        raise SpecDecError(f"the {what} in {str(folder)!r} has {data.get('num_hidden_layers')} layers; "
                           "published EAGLE heads have one")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads"):
        _int(data, key, folder)
    try:
        config = LlamaConfig(**{k: v for k, v in data.items() if k not in ("architectures", "model_type")})
    except (TypeError, ValueError) as exc:
        raise SpecDecError(f"{str(folder / CONFIG_FILE)!r} is not a Llama head config: {exc}") from exc
    hidden = config.hidden_size
    head_vocab = _int(data, "vocab_size", folder, vocab)
    if head_vocab != vocab:
        raise SpecDecError(f"the {what} in {str(folder)!r} is for a vocabulary of {head_vocab} tokens; the target "
                           f"{target.name!r} has {vocab}")
    fc_in = _int(data, "target_hidden_size", folder, hidden) if eagle3 else hidden
    if fc_in != hidden_t:
        raise SpecDecError(f"the {what} in {str(folder)!r} is for a target of hidden size {fc_in}; the target "
                           f"{target.name!r} has {hidden_t}")
    expected = _layer_shapes(config, 2 * hidden if eagle3 else hidden)
    ignored: tuple[str, ...] = ()
    if eagle3:
        draft_vocab = _int(data, "draft_vocab_size", folder, vocab)
        expected.update({"fc.weight": (hidden, 3 * fc_in), "layers.0.input_layernorm.weight": (hidden,),
                         "layers.0.hidden_norm.weight": (hidden,), "norm.weight": (hidden,),
                         "lm_head.weight": (draft_vocab, hidden)})
        if "d2t" in tensors:
            expected["d2t"] = (draft_vocab,)
        if "t2d" in tensors:
            expected["t2d"] = (vocab,)
        layers = aux_layer_ids(data, num_layers, folder)
    else:
        expected["fc.weight"] = (hidden, 2 * hidden)
        if "fc.bias" in tensors:
            expected["fc.bias"] = (hidden,)
        ignored = ("layers.0.input_layernorm.weight",)  # EAGLE-1's layer 0 has no input norm
        layers = []
    if "embed_tokens.weight" in tensors:
        expected["embed_tokens.weight"] = (vocab, hidden)
    elif hidden != hidden_t:
        raise SpecDecError(f"the {what} in {str(folder)!r} is {hidden} wide and has no embed_tokens, so it cannot "
                           f"share the embedding of the target {target.name!r} ({hidden_t} wide)")
    check_tensors(folder, what, tensors, expected, ignored)
    draft_ids = _draft_ids(folder, tensors, vocab) if eagle3 else None
    embed = tensors.pop("embed_tokens.weight", None)
    weights = {k.removeprefix("layers.0."): v.to(target.device, target.dtype) for k, v in tensors.items()
               if k in expected and k not in ("d2t", "t2d")}
    module = PublishedEagle(EAGLE3 if eagle3 else EAGLE1, config, weights,
                            None if draft_ids is None else draft_ids.to(target.device))
    spec = HeadSpec(method, f"published head {folder.name}", "", hidden, vocab,
                    intermediate_size=config.intermediate_size, rms_norm_eps=config.rms_norm_eps, feature_layers=layers)
    return module, spec, None if embed is None else embed.to(target.device, target.dtype)


def _draft_ids(folder: Path, tensors: dict[str, torch.Tensor], vocab: int) -> torch.Tensor | None:
    """The target token of each draft-vocabulary row (``i + d2t[i]``), checked; None without ``d2t`` (the draft
    vocabulary is then the target's, as the ``lm_head`` shape check has made sure)."""
    draft_vocab = tensors["lm_head.weight"].shape[0]
    if "d2t" not in tensors:
        if draft_vocab != vocab:
            raise SpecDecError(f"the EAGLE-3 head in {str(folder)!r} scores {draft_vocab} draft tokens but has no d2t "
                               "map to the target's vocabulary")
        return None
    d2t = tensors["d2t"]
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise SpecDecError(f"the EAGLE-3 head in {str(folder)!r}: d2t must hold integers, not {d2t.dtype}")
    ids = torch.arange(draft_vocab) + d2t.long()
    if ids.min() < 0 or ids.max() >= vocab or ids.unique().numel() != draft_vocab:
        raise SpecDecError(f"the EAGLE-3 head in {str(folder)!r}: d2t does not map its {draft_vocab} draft tokens to "
                           f"distinct tokens of the target's {vocab}")
    t2d = tensors.get("t2d")
    if t2d is not None and (int(t2d.bool().sum()) != draft_vocab or not bool(t2d.bool()[ids].all())):
        raise SpecDecError(f"the EAGLE-3 head in {str(folder)!r}: t2d does not mark the tokens d2t maps to")
    return ids


class ResidualMedusa(nn.Module):
    """Published Medusa heads: head ``i`` is ``len(blocks[i])`` residual blocks ``x + silu(W x + b)`` and its own
    output head ``[V, H]``; ``forward`` gives every head's logits. For inference only: the matrices are packed
    for a CPU's products where that pays (:mod:`specdec.models.cpu_linear`)."""

    def __init__(self, blocks: list[list[tuple[torch.Tensor, torch.Tensor | None]]], heads: list[torch.Tensor]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleList(PackedLinear(weight, bias) for weight, bias in layers)
                                    for layers in blocks)
        self.heads = [pack(h) for h in heads]  # each [V, H], plain or packed

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """``features`` ``[..., H]`` -> logits ``[..., K, V]`` (head ``i`` for the token ``i + 2`` ahead)."""
        out = []
        for linears, head in zip(self.blocks, self.heads):
            x = features
            for block in linears:
                x = x + F.silu(block(x))
            out.append(linear(x, head))
        return torch.stack(out, dim=-2)


def load_medusa(folder: Path, target: CausalLM, lm_head: torch.Tensor) -> tuple[ResidualMedusa, HeadSpec]:
    """Published Medusa heads for ``target`` (FasterDecoding's or vLLM's layout), checked."""
    data = read_config(folder)
    tensors = read_tensors(folder)
    hidden, vocab, _ = target_shape(target, lm_head)
    if "medusa_num_heads" in data or any(k.startswith("medusa_head.") for k in tensors):
        tensors = {k.removeprefix("medusa_head."): v for k, v in tensors.items()}
        num_heads = _int(data, "medusa_num_heads", folder)
        num_layers = _int(data, "medusa_num_layers", folder, 1)

        def block(i: int, j: int) -> str:
            return f"{i}.{j}.linear"

        def head(i: int) -> str:
            return f"{i}.{num_layers}.weight"
    else:
        if "num_heads" not in data and not any(k.startswith("lm_heads.") for k in tensors):
            raise SpecDecError(f"{str(folder)!r} holds no Medusa heads (no medusa_num_heads or num_heads in its "
                               f"config.json, architectures {data.get('architectures')}): give a folder of Medusa "
                               "heads in FasterDecoding's or vLLM's layout, or a folder from specdec train medusa")
        num_heads = _int(data, "num_heads", folder)
        num_layers = _int(data, "num_hidden_layers", folder, 1)
        if data.get("truncated_vocab_size") not in (None, data.get("vocab_size")) or "token_map" in tensors:
            raise SpecDecError(f"the Medusa heads in {str(folder)!r} use a truncated vocabulary (token_map), which "
                               "specdec does not load")

        def block(i: int, j: int) -> str:
            return f"blocks.{i}.layers.{j}"

        def head(i: int) -> str:
            return f"lm_heads.{i}.weight"
    head_hidden = data.get("hidden_size", hidden)
    if head_hidden != hidden:
        raise SpecDecError(f"the Medusa heads in {str(folder)!r} are for a target of hidden size {head_hidden}; the "
                           f"target {target.name!r} has {hidden}")
    head_vocab = data.get("vocab_size", vocab)
    if head_vocab != vocab:
        raise SpecDecError(f"the Medusa heads in {str(folder)!r} are for a vocabulary of {head_vocab} tokens; the "
                           f"target {target.name!r} has {vocab}")
    expected: dict[str, tuple[int, ...]] = {}
    for i in range(num_heads):
        for j in range(num_layers):
            expected[f"{block(i, j)}.weight"] = (hidden, hidden)
            if f"{block(i, j)}.bias" in tensors:
                expected[f"{block(i, j)}.bias"] = (hidden,)
        expected[head(i)] = (vocab, hidden)
    check_tensors(folder, "Medusa heads", tensors, expected)

    def get(name: str) -> torch.Tensor | None:
        return tensors[name].to(target.device, target.dtype) if name in tensors else None

    blocks = [[(get(f"{block(i, j)}.weight"), get(f"{block(i, j)}.bias")) for j in range(num_layers)]
              for i in range(num_heads)]
    module = ResidualMedusa(blocks, [get(head(i)) for i in range(num_heads)]).eval()
    return module, HeadSpec("medusa", f"published heads {folder.name}", "", hidden, vocab, num_heads=num_heads)
