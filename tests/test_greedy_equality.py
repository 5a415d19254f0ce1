"""Greedy speculative output equals transformers' own greedy ``generate``, token for token."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec import LLM, SamplingParams

PROMPTS = [[3, 5, 7, 3, 5, 7, 11, 3, 5], [42, 1, 17, 29, 8, 64, 2]]
MAX_TOKENS = 40
COMBOS = [("llama", "fast"), ("llama", "hf"), ("qwen2", "fast"), ("qwen2", "hf"), ("gpt2", "hf")]
DRAFTERS = ["same", "random", "truncated", "ngram"]


@pytest.fixture(scope="module")
def references(model_dirs):
    """transformers' greedy continuation of each prompt, per architecture."""
    refs = {}
    for arch, dirs in model_dirs.items():
        model = AutoModelForCausalLM.from_pretrained(dirs["target"], dtype=torch.float64)
        refs[arch] = []
        for prompt in PROMPTS:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            refs[arch].append(out[0, len(prompt):].tolist())
    return refs


def speculative_config(dirs, drafter, k):
    if drafter == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3,
                "prompt_lookup_min": 1}
    return {"method": "draft_model", "model": str(dirs[drafter]), "num_speculative_tokens": k}


@pytest.mark.parametrize("arch,backend", COMBOS)
def test_plain_decoding_matches_transformers(model_dirs, references, arch, backend):
    llm = LLM(model_dirs[arch]["target"], dtype="float64", backend=backend)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outputs] == references[arch]
    assert all(o.metrics.mean_acceptance_length == 1.0 for o in outputs)


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("arch,backend", COMBOS)
def test_speculative_greedy_matches_transformers(model_dirs, references, arch, backend, drafter, k):
    dirs = model_dirs[arch]
    llm = LLM(dirs["target"], speculative_config=speculative_config(dirs, drafter, k), dtype="float64",
              backend=backend)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for output, reference in zip(outputs, references[arch], strict=True):
        assert output.outputs[0].token_ids == reference
        assert output.outputs[0].finish_reason == "length"
        metrics = output.metrics
        assert metrics.num_generated_tokens == MAX_TOKENS
        assert metrics.num_accepted_tokens <= metrics.num_draft_tokens
        if drafter == "same":
            # An identical draft is always accepted: every step but the last emits k + 1 tokens.
            assert metrics.acceptance_rate == 1.0
            assert metrics.num_steps == -(-MAX_TOKENS // (k + 1))
