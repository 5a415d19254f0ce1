"""The drafting method a ``speculative_config`` without a ``"method"`` means, read from its ``model`` (vLLM infers
it too, from the model's name):

- a folder of heads trained by specdec: the method its ``config.json`` names (an early-exit adapter's:
  ``layer_skip``, whose trained form it is);
- a published EAGLE-3 head (``architectures: ["LlamaForCausalLMEagle3"]``): ``eagle3``;
- a published Medusa folder (``medusa_num_heads`` in its config): ``medusa``;
- anything else (a draft model's folder, a hub id, a loaded model): ``draft_model``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from specdec.errors import SpecDecError

CONFIG_FILE = "config.json"  # specdec.drafters.heads.common's, read here before any head module loads
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
HEAD_METHODS = {"early_exit": "layer_skip"}
"""A heads folder's ``method`` -> the drafting method that runs it, where the two names differ."""


def method_of(model: Any) -> str:
    """The method ``model`` (a ``speculative_config["model"]``) is drafted with; see the module docstring."""
    if not isinstance(model, (str, os.PathLike)) or not (Path(model) / CONFIG_FILE).is_file():
        return "draft_model"
    try:
        config = json.loads((Path(model) / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecDecError(f"cannot read {str(Path(model) / CONFIG_FILE)!r}: {exc}") from None
    if not isinstance(config, dict):
        return "draft_model"
    if "target_fingerprint" in config and isinstance(config.get("method"), str):
        return HEAD_METHODS.get(config["method"], config["method"])
    if EAGLE3_ARCHITECTURE in (config.get("architectures") or []):
        return "eagle3"
    if "medusa_num_heads" in config:
        return "medusa"
    return "draft_model"
