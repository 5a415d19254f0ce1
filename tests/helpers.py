"""Tiny random models for the tests, built in memory (float64, see conftest)."""

from __future__ import annotations

import copy

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 96
CONTEXT = 192

ARCHS = {
    "llama": lambda vocab, layers: LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
        eos_token_id=None, bos_token_id=None)),
    "qwen2": lambda vocab, layers: Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
        eos_token_id=None, bos_token_id=None)),
    "gpt2": lambda vocab, layers: GPT2LMHeadModel(GPT2Config(
        vocab_size=vocab, n_embd=32, n_layer=layers, n_head=4, n_positions=CONTEXT,
        eos_token_id=None, bos_token_id=None)),
}


def build_model(arch: str, seed: int, vocab: int = VOCAB, layers: int = 3, scale: float = 1.0):
    """A float64 random model; ``scale`` multiplies every weight (sharper distributions)."""
    torch.manual_seed(seed)
    model = ARCHS[arch](vocab, layers).to(torch.float64).eval()
    if scale != 1.0:
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(scale)
    return model


def truncated_copy(model, keep_layers: int):
    """The target with its last layers dropped: agrees with it on some tokens."""
    small = copy.deepcopy(model)
    base = small.model if hasattr(small, "model") else small.transformer
    if hasattr(base, "layers"):
        base.layers = base.layers[:keep_layers]
    else:
        base.h = base.h[:keep_layers]
    small.config.num_hidden_layers = keep_layers
    if hasattr(small.config, "layer_types") and small.config.layer_types:
        small.config.layer_types = small.config.layer_types[:keep_layers]
    return small


def make_sequence(request_id: str, prompt: list[int], params, seed: int = 0, max_new_tokens: int | None = None,
                  stop_ids: frozenset[int] = frozenset()):
    """A :class:`~specdec.sequence.Sequence` to hand to ``llm.scheduler.add`` directly."""
    from specdec.sequence import Sequence

    return Sequence(
        request_id=request_id, prompt_ids=list(prompt), params=params,
        generator=torch.Generator().manual_seed(seed),
        max_new_tokens=params.max_tokens if max_new_tokens is None else max_new_tokens, stop_ids=stop_ids,
    )
