"""The interface every model backend implements: a causal LM that owns one KV cache.

The cache holds keys and values for the first ``length`` tokens of the current sequence.
``forward`` appends tokens at positions ``length .. length+T-1`` and returns their logits;
``crop`` rolls the cache back to a shorter prefix. Rolling back is what makes speculation
cheap: rejected draft tokens are forgotten without recomputing the accepted ones.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class CachedLM(ABC):
    """A causal LM plus its KV cache for one sequence (batch size 1).

    Attributes set by each backend: ``vocab_size`` (logit width), ``max_length`` (context
    window in tokens), ``device``, ``dtype`` and ``name`` (the model's folder or id, for
    messages).
    """

    vocab_size: int
    max_length: int
    device: torch.device
    dtype: torch.dtype
    name: str

    @property
    @abstractmethod
    def length(self) -> int:
        """Number of tokens whose keys and values are cached."""

    @abstractmethod
    def reset(self) -> None:
        """Forget the cached sequence (start of a new request)."""

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, num_logits: int | None = None) -> torch.Tensor:
        """Append ``input_ids`` ``[1, T]`` to the cache and return logits ``[1, n, V]``.

        ``n`` is ``T`` when ``num_logits`` is None, else the last ``num_logits`` positions
        (0 returns an empty tensor and skips the output head: a prefill).
        """

    @abstractmethod
    def crop(self, length: int) -> None:
        """Roll the cache back to its first ``length`` tokens (``length <= self.length``)."""
