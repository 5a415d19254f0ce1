"""The bench's roofline: the measured read bandwidth and the bytes a plain decoding step reads."""

from __future__ import annotations

import math

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.bench.hardware import measure_read_bandwidth_gbs, parameter_bytes, step_read_bytes


def _llama(tied: bool) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(config).to(torch.bfloat16)


def test_step_read_bytes_counts_the_output_head_once_and_the_kv_cache():
    tied, untied = _llama(True), _llama(False)
    kv = 2 * 3 * 2 * 8 * 50 * 2  # keys and values, 3 layers, 2 KV heads of 8, 50 tokens, bf16
    assert step_read_bytes(tied, 50) == (parameter_bytes(tied), kv)
    # untied: the embedding table is not read, only one row of it
    assert step_read_bytes(untied, 50) == (parameter_bytes(untied) - 99 * 32 * 2, kv)
    assert step_read_bytes(tied, 0)[1] == 0


def test_read_probe_measures_a_plausible_bandwidth():
    gbs = measure_read_bandwidth_gbs(torch.device("cpu"), num_bytes=64 * 2**20, trials=2)
    assert math.isfinite(gbs) and 0.1 < gbs < 10_000
