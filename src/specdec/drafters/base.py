"""The drafter interface, the speculative configuration and the registry of methods.

A drafter proposes the next draft tokens of one request. The engine calls
``begin`` once per request, then per step ``propose`` and, after verification, ``observe``.
It never inspects the drafter's type: class attributes say what a method is, and new
methods plug in with ``@register_drafter`` without touching the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch

from specdec.errors import SpecDecError
from specdec.models.base import CachedLM
from specdec.models.loader import ModelSource
from specdec.sampling import SamplingParams

MAX_SPECULATIVE_TOKENS = 64


@dataclass
class SpeculativeConfig:
    """vLLM-style ``speculative_config``: which drafter, and how many tokens per step.

    ``method``: a registered drafter name (``"draft_model"``, ``"ngram"``). ``model``: the
    draft model's folder, hub id or a loaded ``PreTrainedModel`` (draft_model; several
    ``LLM``s can share one loaded draft). ``dtype``: the draft model's dtype (None: see
    :func:`specdec.drafters.draft_model.resolve_draft_dtype`). ``prompt_lookup_max``/
    ``prompt_lookup_min``: the longest and shortest n-gram matched against the context (ngram).
    """

    method: str
    num_speculative_tokens: int = 4
    model: ModelSource | None = None
    dtype: str | None = None
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1

    def __post_init__(self) -> None:
        if self.method not in DRAFTERS:
            raise SpecDecError(
                f"unknown speculative method {self.method!r}; choose one of {', '.join(sorted(DRAFTERS))}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpecDecError(f"num_speculative_tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        DRAFTERS[self.method].check_config(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeculativeConfig:
        """Build from a plain dict, rejecting unknown keys by name."""
        if not isinstance(data, dict):
            raise SpecDecError(f"speculative_config must be a dict, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecDecError(f"unknown speculative_config keys {unknown}; known keys are {sorted(known)}")
        if "method" not in data:
            raise SpecDecError("speculative_config needs a 'method'")
        return cls(**data)


@dataclass
class Draft:
    """One step's proposal: ``tokens`` ``[1, k']`` (``k' <= k``, possibly 0) and the
    distributions ``probs`` ``[1, k', V]`` they were sampled from, or None when the drafter
    is deterministic or decoding is greedy."""

    tokens: torch.Tensor
    probs: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]


@dataclass
class LoadOptions:
    """What a drafter needs to load a model of its own: the target's device, backend and
    tokenizer (None when the target has none, used to check that they agree). The target's
    dtype is the loaded target's own, ``target.dtype``."""

    device: torch.device
    backend: str
    target_tokenizer: Any = None


class Drafter(ABC):
    """Proposes draft tokens for one request at a time.

    ``context`` is always the committed token ids of the request (prompt and generated),
    the last one being the pending token that the target has not yet cached.
    """

    method: ClassVar[str]
    #: True when drafts are not sampled (``Draft.probs`` is None): verified with a one-hot ``q``.
    deterministic: ClassVar[bool]

    @classmethod  # noqa: B027 - an optional hook, not abstract
    def check_config(cls, config: SpeculativeConfig) -> None:
        """Raise SpecDecError when ``config`` lacks what this method needs."""

    @classmethod
    @abstractmethod
    def from_config(cls, config: SpeculativeConfig, target: CachedLM, options: LoadOptions) -> Drafter:
        """Build the drafter for ``target``, loading whatever it needs."""

    @abstractmethod
    def begin(self, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator) -> None:
        """Start a request: reset state and absorb the prompt."""

    @abstractmethod
    def propose(self, context: list[int], k: int) -> Draft:
        """Propose up to ``k`` tokens that follow ``context``."""

    @abstractmethod
    def observe(self, context: list[int], num_accepted: int) -> None:
        """Learn the outcome of the last step: ``num_accepted`` drafts were kept and ``context`` is
        the new committed sequence. Roll back any state built on rejected drafts."""


DRAFTERS: dict[str, type[Drafter]] = {}


def register_drafter(cls: type[Drafter]) -> type[Drafter]:
    """Class decorator: make ``cls`` available as ``speculative_config["method"] == cls.method``."""
    DRAFTERS[cls.method] = cls
    return cls


def create_drafter(config: SpeculativeConfig, target: CachedLM, options: LoadOptions) -> Drafter:
    return DRAFTERS[config.method].from_config(config, target, options)
