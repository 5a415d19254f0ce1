"""specdec: lossless speculative decoding for Hugging Face causal language models.

The public names are imported lazily, so that ``import specdec`` (and ``specdec --help``)
does not pay for importing torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

_EXPORTS = {
    "LLM": "specdec.llm",
    "CompletionOutput": "specdec.outputs",
    "RequestOutput": "specdec.outputs",
    "StreamOutput": "specdec.outputs",
    "Logprob": "specdec.logprobs",
    "Drafter": "specdec.drafters",
    "SpeculativeConfig": "specdec.drafters",
    "register_drafter": "specdec.drafters",
    "RequestMetrics": "specdec.metrics",
    "SamplingParams": "specdec.sampling",
    "SpecDecError": "specdec.errors",
    "StructuredOutputsParams": "specdec.structured",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
