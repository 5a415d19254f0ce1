"""Batched greedy speculative output equals transformers' own greedy ``generate`` of each prompt
alone, token for token.

Every test submits all nine prompts (lengths 1 to 17, different ``max_tokens``, so rows
leave the batch at different steps) in one ``generate`` call; with ``max_num_seqs`` below
the number of prompts the rest wait in the queue and take the freed slots.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec import LLM, SamplingParams

PROMPTS = [
    [3, 5, 7, 3, 5, 7, 11, 3, 5],
    [42, 1, 17, 29, 8, 64, 2],
    [7],
    [10, 20],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
    [90, 91, 90, 91, 90],
    [33, 3, 33, 3, 33, 3],
    [55, 44, 33, 22, 11, 0, 12, 23, 34, 45, 56, 67, 78],
    [60, 5, 60, 6],
]
MAX_TOKENS = [40, 24, 31, 12, 40, 17, 35, 9, 28]
FAST = [("llama", "fast"), ("qwen2", "fast"), ("gpt2", "hf")]
DRAFTERS = ["same", "random", "truncated", "ngram"]


def greedy_references(dirs: dict, **load_kwargs) -> dict[str, list[list[int]]]:
    """transformers' greedy continuation of each of :data:`PROMPTS` alone (:data:`MAX_TOKENS` new tokens),
    per architecture: ``dirs[arch]["target"]`` loaded in float64 with ``load_kwargs``."""
    refs = {}
    for arch, folders in dirs.items():
        model = AutoModelForCausalLM.from_pretrained(folders["target"], dtype=torch.float64, **load_kwargs)
        refs[arch] = []
        for prompt, max_tokens in zip(PROMPTS, MAX_TOKENS):
            # An explicit mask: without one, generate masks prompt tokens equal to pad_token_id.
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            refs[arch].append(out[0, len(prompt):].tolist())
    return refs


@pytest.fixture(scope="module")
def references(model_dirs):
    """transformers' greedy continuation of each prompt alone, per architecture."""
    return greedy_references(model_dirs)


def speculative_config(dirs, drafter, k):
    if drafter == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    return {"method": "draft_model", "model": str(dirs[drafter]), "num_speculative_tokens": k}


def run_batch(llm):
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)


def check_outputs(outputs, references):
    assert len(outputs) == len(PROMPTS)
    for output, prompt, reference in zip(outputs, PROMPTS, references, strict=True):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == reference
        assert output.outputs[0].finish_reason == "length"
        assert output.metrics.num_generated_tokens == len(reference)


@pytest.mark.parametrize("max_num_seqs", [3, 16])
@pytest.mark.parametrize("arch,backend", [*FAST, ("llama", "hf"), ("qwen2", "hf")])
def test_plain_batched_decoding_matches_transformers(model_dirs, references, arch, backend, max_num_seqs):
    llm = LLM(model_dirs[arch]["target"], dtype="float64", backend=backend, max_num_seqs=max_num_seqs)
    outputs = run_batch(llm)
    check_outputs(outputs, references[arch])
    assert all(o.metrics.mean_acceptance_length == 1.0 for o in outputs)
    batch = llm.batch_metrics
    assert batch.num_generated_tokens == sum(MAX_TOKENS)
    assert batch.num_rows == sum(MAX_TOKENS)  # plain decoding: one row per token
    assert (2.0 if max_num_seqs == 3 else 4.0) < batch.mean_batch_size <= max_num_seqs
    assert max(llm.engine.cache.lengths) == 0 and not llm.scheduler.has_work


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("arch,backend", FAST)
def test_speculative_batched_greedy_matches_transformers(model_dirs, references, arch, backend, drafter, k):
    dirs = model_dirs[arch]
    max_num_seqs = 4 if k == 1 else 16  # k=1 also exercises the queue
    llm = LLM(dirs["target"], speculative_config=speculative_config(dirs, drafter, k), dtype="float64",
              backend=backend, max_num_seqs=max_num_seqs)
    outputs = run_batch(llm)
    check_outputs(outputs, references[arch])
    for output, max_tokens in zip(outputs, MAX_TOKENS):
        metrics = output.metrics
        assert metrics.num_accepted_tokens <= metrics.num_draft_tokens
        if drafter == "same":
            # An identical draft is always accepted: every step but the last emits k + 1 tokens.
            assert metrics.acceptance_rate == 1.0
            assert metrics.num_steps == -(-max_tokens // (k + 1))
    if drafter != "ngram":
        assert llm.batch_metrics.num_draft_tokens > 0
    assert max(llm.engine.cache.lengths) == 0 and not llm.scheduler.has_work


@pytest.mark.parametrize("drafter", ["random", "ngram"])
def test_speculative_batched_greedy_on_hf_backend_for_llama(model_dirs, references, drafter):
    """The transformers path for an architecture the fast backend also covers."""
    dirs = model_dirs["llama"]
    llm = LLM(dirs["target"], speculative_config=speculative_config(dirs, drafter, 4), dtype="float64",
              backend="hf", max_num_seqs=5)
    check_outputs(run_batch(llm), references["llama"])


def test_ngram_drafts_are_used_in_a_batch(model_dirs, references):
    """Guard: repetitive prompts make the n-gram drafter propose and get accepted, so the ngram
    cases above test verification, not only plain decoding."""
    dirs = model_dirs["llama"]
    llm = LLM(dirs["target"], speculative_config=speculative_config(dirs, "ngram", 4), dtype="float64")
    outputs = run_batch(llm)
    check_outputs(outputs, references["llama"])
    assert sum(o.metrics.num_draft_tokens for o in outputs) > 20
    assert sum(o.metrics.num_accepted_tokens for o in outputs) > 5


@pytest.mark.parametrize("backend", ["fast", "hf"])
def test_draft_with_a_shorter_context_than_the_target(model_dirs, tmp_path, backend):
    """Rows whose context outgrows the draft's window stop drafting (or never start) while the
    other rows of the batch go on drafting; every output is still the target's greedy one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
                         eos_token_id=None, bos_token_id=None)
    LlamaForCausalLM(config).double().save_pretrained(tmp_path / "short")
    spec = {"method": "draft_model", "model": str(tmp_path / "short"), "num_speculative_tokens": 4}
    llm = LLM(model_dirs["llama"]["target"], speculative_config=spec, dtype="float64", max_num_seqs=3,
              backend=backend)
    prompts = [[1 + i % 50 for i in range(n)] for n in (10, 45, 60, 3)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=30))
    target = AutoModelForCausalLM.from_pretrained(model_dirs["llama"]["target"], dtype=torch.float64)
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert output.outputs[0].token_ids == ref
    drafted = [o.metrics.num_draft_tokens for o in outputs]
    assert drafted[2] == 0 and 0 < drafted[1] < min(drafted[0], drafted[3])


@pytest.mark.parametrize("method", ["plain", "draft_model", "ngram"])
def test_max_model_len_cuts_each_row(model_dirs, references, method):
    """With ``max_model_len`` 24, rows of the batch end at 24 tokens (prompt + output) or at their
    own ``max_tokens``, whichever comes first."""
    dirs = model_dirs["llama"]
    spec = None if method == "plain" else speculative_config(dirs, "same" if method == "draft_model" else method, 4)
    llm = LLM(dirs["target"], speculative_config=spec, dtype="float64", max_num_seqs=4, max_model_len=24)
    outputs = run_batch(llm)
    for prompt, max_tokens, ref, output in zip(PROMPTS, MAX_TOKENS, references["llama"], outputs):
        n = min(max_tokens, 24 - len(prompt))
        assert output.outputs[0].token_ids == ref[:n]
        assert output.outputs[0].finish_reason == "length"
    assert llm.engine.cache.capacity == 24
