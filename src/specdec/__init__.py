"""specdec: lossless speculative decoding for Hugging Face causal language models."""

from specdec.drafters import Drafter, SpeculativeConfig, register_drafter
from specdec.errors import SpecDecError
from specdec.llm import LLM, CompletionOutput, RequestOutput, StreamOutput
from specdec.metrics import RequestMetrics
from specdec.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "Drafter",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "SpecDecError",
    "SpeculativeConfig",
    "StreamOutput",
    "register_drafter",
]
