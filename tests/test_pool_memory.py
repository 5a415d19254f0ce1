"""A long-context config does not make the KV pools huge: ``max_model_len`` defaults to at most
``DEFAULT_MAX_MODEL_LEN``, and a pool that does not fit the available memory is refused before it is
allocated, with its size and the knobs that shrink it."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec import LLM
from specdec.errors import SpecDecError
from specdec.llm import DEFAULT_MAX_MODEL_LEN
from specdec.models import base

LONG = 131072


def long_context_llama(layers: int = 1) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=LONG, bos_token_id=None, eos_token_id=None)).eval()


@pytest.mark.parametrize("backend", ["fast", "hf"])
def test_long_context_config_gets_the_default_length(backend):
    llm = LLM(long_context_llama(), dtype="float32", backend=backend, max_num_seqs=16)
    assert llm.max_model_len == DEFAULT_MAX_MODEL_LEN < LONG
    assert llm.engine.cache.capacity == DEFAULT_MAX_MODEL_LEN
    with pytest.raises(SpecDecError, match=f"max_model_len is {DEFAULT_MAX_MODEL_LEN}"):
        llm.encode_prompt({"prompt_token_ids": [1] * DEFAULT_MAX_MODEL_LEN})


def test_explicit_length_above_the_default():
    llm = LLM(long_context_llama(), dtype="float32", backend="fast", max_num_seqs=1, max_model_len=2 * 8192)
    assert llm.engine.cache.capacity == 2 * 8192


def test_pool_that_does_not_fit_is_refused(monkeypatch):
    monkeypatch.setattr(base, "available_memory", lambda device: 1 << 20)
    with pytest.raises(SpecDecError, match=r"needs 0\.02 GiB \(16 slots x 8192 tokens\) but 0\.00 GiB of cpu memory "
                                           r"is available, of which a pool may take 90%; lower max_model_len .* "
                                           r"or max_num_seqs"):
        LLM(long_context_llama(), dtype="float32", backend="fast", max_num_seqs=16)


def test_draft_pool_that_does_not_fit_is_refused(monkeypatch):
    """The drafter's pool is checked too: here the target's fits and the draft model's does not."""
    per_layer = 2 * 16 * 2 * (DEFAULT_MAX_MODEL_LEN + 1) * 8 * 4  # keys and values, slots, heads, length, dim
    monkeypatch.setattr(base, "available_memory", lambda device: int(1.5 * per_layer / base.POOL_MEMORY_FRACTION))
    draft = long_context_llama(layers=2)
    draft.config._name_or_path = "tiny-draft"
    with pytest.raises(SpecDecError, match="KV cache of 'tiny-draft' needs"):
        LLM(long_context_llama(), dtype="float32", backend="fast", max_num_seqs=16,
            speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 2})


def test_llms_over_one_loaded_model_share_its_fast_backend(model_dirs):
    """Every LLM built over one loaded model shares one fast backend (its weight copies are the model's size
    again: one per method in a bench over a 1B target ran out of memory), while each keeps its own KV pool:
    interleaved calls give each LLM plain decoding's tokens."""
    from transformers import AutoModelForCausalLM

    from specdec import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"]["target"], dtype=torch.float64)
    plain = LLM(model, dtype="float64")
    ngram = LLM(model, dtype="float64", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert plain.target is ngram.target
    assert LLM(model_dirs["llama"]["target"], dtype="float64").target is not plain.target  # a folder: its own model
    params = SamplingParams(temperature=0, max_tokens=16)
    prompts = [{"prompt_token_ids": [3, 5, 7, 3, 5, 7, 3]}, {"prompt_token_ids": [9, 2]}]
    first = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in ngram.generate(prompts, params)] == first
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params)] == first
