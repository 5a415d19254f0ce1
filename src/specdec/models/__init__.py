"""Causal LMs over a pool of rollback-able KV slots: the contract and its backends."""

from specdec.models.base import CausalLM, ForwardBatch, ForwardOutput, KVCache
from specdec.models.loader import load_causal_lm

__all__ = ["CausalLM", "ForwardBatch", "ForwardOutput", "KVCache", "load_causal_lm"]
