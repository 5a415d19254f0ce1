"""Architectures beyond the fast backend's run through the transformers fallback (``backend="hf"``):
greedy output, plain and speculative, equals transformers' own greedy ``generate``, token for token.

Sliding windows (Mistral, Gemma 2, Gemma 3) are crossed by the prompt and the generation, and the
tests check that the window changes the output (so a mask that ignored it would fail). Recurrent and
hybrid models (Mamba, Jamba) run with the replay rollback; a random draft model gets drafts
rejected, so every architecture is rolled back many times.
"""

import pytest
import torch
from fallback_archs import CONFIGS, WINDOW, build, dtype
from transformers import GPT2Config, GPT2LMHeadModel, cache_utils

from specdec import LLM, SamplingParams
from specdec.errors import SpecDecError
from specdec.models.hf import HFCausalLM

PROMPTS = [[3, 5, 7, 3, 5, 7, 11, 3, 5], [42, 1, 17, 29, 8]]
MAX_TOKENS = [20, 12]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
RECURRENT = {"mamba", "jamba"}
WINDOWED = {"mistral", "gemma2", "gemma3_text"}
STATE_LAYERS = hasattr(cache_utils, "LinearAttentionCacheLayerMixin")
"""Whether this transformers keeps recurrent states in cache layers; before that, Mamba and Jamba
kept them in their own cache classes, which the fallback refuses."""


def reference(model) -> list[list[int]]:
    """transformers' greedy continuation of each prompt alone."""
    outputs = []
    for prompt, max_tokens in zip(PROMPTS, MAX_TOKENS):
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def run(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_fallback_greedy_equals_transformers(arch):
    target = build(arch, seed=0)
    if arch in RECURRENT and not STATE_LAYERS:
        with pytest.raises(SpecDecError, match="own cache class"):
            LLM(target, backend="hf", dtype=dtype(arch))
        return
    expected = reference(target)
    for spec in (None, NGRAM, {"method": "draft_model", "model": build(arch, seed=1), "num_speculative_tokens": 3}):
        llm = LLM(target, backend="hf", dtype=dtype(arch), speculative_config=spec, max_num_seqs=2)
        assert isinstance(llm.target, HFCausalLM)
        assert llm.target.replay == (arch in RECURRENT)
        assert run(llm) == expected, (arch, spec and spec["method"])
        if spec is not None and spec["method"] == "draft_model":
            metrics = llm.batch_metrics
            assert metrics.num_accepted_tokens < metrics.num_draft_tokens  # rejections: rollbacks ran


@pytest.mark.parametrize("arch", sorted(WINDOWED))
def test_crossed_sliding_window_is_kept(arch):
    """The window is crossed and matters: the same weights with a window of the whole context
    generate other tokens; through specdec the windowed model still equals transformers."""
    windowed, wide = build(arch, seed=0), build(arch, seed=0, sliding_window=64)
    assert windowed.config.sliding_window == WINDOW < len(PROMPTS[0])
    expected = reference(windowed)
    assert reference(wide) != expected
    llm = LLM(windowed, backend="hf", dtype=dtype(arch), speculative_config=NGRAM, max_num_seqs=2)
    pool = llm.engine.cache
    assert run(llm) == expected
    assert all(not getattr(layer, "is_sliding", False) for cache in pool.caches for layer in cache.layers)


class ToyStateCache:
    """A model-specific cache class, as Mamba's ``MambaCache`` was before transformers' cache layers."""


class ToyStateLM(GPT2LMHeadModel):
    """A model whose modeling module defines its own cache class."""


def test_model_with_its_own_cache_class_is_refused():
    model = ToyStateLM(GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=16))
    with pytest.raises(SpecDecError, match="own cache class 'ToyStateCache'"):
        LLM(model, backend="hf")
