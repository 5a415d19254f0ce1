"""Inflating checkpoint folders: read a Llama/Qwen2 folder's config and safetensors weights, write the
inflated folder (``config.json``, ``model.safetensors``, the tokenizer and other side files, and
``inflated.json`` saying what it was made from)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from specdec.cli_checks import check_new_folder
from specdec.errors import SpecDecError
from specdec.inflate.model import Inflated, inflate_weights
from specdec.shapes import get_shape
from specdec.tensor_files import save_tensors

INFLATED_FILE = "inflated.json"
"""Written into every inflated folder: the source, the shape and the parameter count."""
_NOT_COPIED = ("config.json", "train_summary.json", "training_log.jsonl", INFLATED_FILE)


def read_checkpoint(folder: str | os.PathLike[str]) -> tuple[Any, dict[str, torch.Tensor]]:
    """The transformers config and the safetensors weights of a checkpoint folder (one file or shards)."""
    from transformers import AutoConfig

    path = Path(folder)
    if not (path / "config.json").is_file():
        raise SpecDecError(f"{str(path)!r} is not a checkpoint folder (no config.json)")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        raise SpecDecError(f"cannot read the config in {str(path)!r}: {exc}") from exc
    files = sorted(p for p in path.glob("*.safetensors") if p.name.startswith("model"))
    if not files:
        raise SpecDecError(f"{str(path)!r} has no model*.safetensors weights (inflation reads safetensors only)")
    state: dict[str, torch.Tensor] = {}
    try:
        for file in files:
            state.update(load_file(str(file)))
    except (OSError, SafetensorError) as exc:
        raise SpecDecError(f"cannot read the weights in {str(path)!r}: {exc}") from exc
    return config, state


def write_checkpoint(inflated: Inflated, folder: str | os.PathLike[str], source: str | os.PathLike[str],
                     shape_name: str) -> None:
    """Write ``inflated`` into ``folder`` (created), copying ``source``'s tokenizer and other side files."""
    out, src = Path(folder), Path(source)
    out.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        weights = file.suffix in (".safetensors", ".bin") and file.name.startswith(("model", "pytorch_model"))
        if file.is_file() and not weights and file.name not in _NOT_COPIED and not file.name.endswith(".index.json"):
            shutil.copy2(file, out / file.name)
    inflated.config.save_pretrained(out)
    save_tensors({n: t.contiguous() for n, t in inflated.state.items()}, out / "model.safetensors",
                 metadata={"format": "pt"})
    note = {"source": str(src), "shape": shape_name, "num_parameters": inflated.num_parameters,
            "layer_at": list(inflated.layout.layer_at),
            "note": "function-preserving inflation: zero-padded widths, added heads/units/layers with zero output "
                    "projections, RMSNorm weights x sqrt(d/D) and eps x d/D; same logits as the source"}
    (out / INFLATED_FILE).write_text(json.dumps(note, indent=2) + "\n")


def inflate_checkpoint(source: str | os.PathLike[str], dest: str | os.PathLike[str], shape: str) -> Inflated:
    """Inflate the Llama/Qwen2 checkpoint folder ``source`` to the named ``shape`` into the folder ``dest``
    (which must not exist or be empty) and return it (:class:`~specdec.inflate.model.Inflated`: its
    ``num_parameters`` is the real count, the vocabulary is not padded). The logits of ``dest`` equal
    those of ``source`` up to floating-point rounding; it needs as much memory as the inflated weights.

    Example: ``inflate_checkpoint("my-llama", "my-llama-1b", "1b")``."""
    out = Path(dest)
    check_new_folder(out, "dest")
    config, state = read_checkpoint(source)
    inflated = inflate_weights(state, config, get_shape(shape), shape)
    write_checkpoint(inflated, out, source, shape)
    return inflated
