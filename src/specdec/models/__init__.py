"""Causal LMs with a KV cache that can be rolled back: the interface and its backends."""

from specdec.models.base import CachedLM
from specdec.models.loader import load_cached_lm

__all__ = ["CachedLM", "load_cached_lm"]
