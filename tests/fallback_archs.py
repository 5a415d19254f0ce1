"""Tiny random configs of architectures that run through the transformers fallback (``backend="hf"``).

Each entry builds a float64 model in memory: a few layers of width 32, a vocabulary of ``VOCAB``
tokens and 64 positions. Sliding windows are ``WINDOW`` tokens, so a generation of a few dozen
tokens crosses them.
"""

from __future__ import annotations

import torch
import transformers as tf

VOCAB = 96
WINDOW = 4
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=None)
GQA = dict(SMALL, num_key_value_heads=2)
GEMMA = dict(GQA, head_dim=8)

CONFIGS = {
    "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  bos_token_id=None, eos_token_id=None),
    "gpt_neox": lambda: tf.GPTNeoXConfig(**SMALL),
    "opt": lambda: tf.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                                bos_token_id=None, eos_token_id=None, pad_token_id=1),
    "falcon": lambda: tf.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      bos_token_id=None, eos_token_id=None),
    "stablelm": lambda: tf.StableLmConfig(**GQA),
    "olmo": lambda: tf.OlmoConfig(**GQA),
    "olmo2": lambda: tf.Olmo2Config(**GQA),
    "phi": lambda: tf.PhiConfig(**GQA),
    "phi3": lambda: tf.Phi3Config(**GQA),
    "gemma": lambda: tf.GemmaConfig(**GEMMA),
    "gemma2": lambda: tf.Gemma2Config(**GEMMA, sliding_window=WINDOW),
    "gemma3_text": lambda: tf.Gemma3TextConfig(**dict(GEMMA, num_hidden_layers=3), sliding_window=WINDOW,
                                               layer_types=["sliding_attention", "full_attention",
                                                            "sliding_attention"]),
    "mistral": lambda: tf.MistralConfig(**GQA, sliding_window=WINDOW),
    "qwen3": lambda: tf.Qwen3Config(**GQA, head_dim=8),
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(**GQA, head_dim=8, moe_intermediate_size=16, num_experts=4,
                                           num_experts_per_tok=2),
    "mamba": lambda: tf.MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=4,
                                    bos_token_id=None, eos_token_id=None, pad_token_id=None),
    "jamba": lambda: tf.JambaConfig(**GQA, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                    expert_layer_offset=1, num_experts=2, mamba_d_state=4, use_mamba_kernels=False),
}


STD = {"gemma": 0.5, "gemma2": 0.03, "gemma3_text": 0.03, "mamba": 0.5, "olmo2": 1.0}
"""Standard deviation of every weight matrix (0.2 where not named), found per architecture so that
greedy continuations vary (and drafts miss) rather than repeat one token."""

EXPERTS = ("qwen3_moe", "jamba")
"""Mixture-of-experts models: their default expert kernel (grouped matmul) takes no float64, so they
run in float32."""


def build(arch: str, seed: int = 0, **overrides) -> tf.PreTrainedModel:
    """A random model of ``arch`` (a key of ``CONFIGS``) in :func:`dtype`; ``overrides`` set config fields."""
    config = CONFIGS[arch]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # wider than transformers' init (std 0.02), whose tiny models repeat one token
        for name, param in model.named_parameters():
            if param.ndim >= 2 and "A_log" not in name:
                param.normal_(0.0, STD.get(arch, 0.2))
    return model.to(dtype(arch)).eval()


def dtype(arch: str) -> torch.dtype:
    """float64 (no near-tie between two logits can flip with the shape of a forward), float32 for experts."""
    return torch.float32 if arch in EXPERTS else torch.float64
