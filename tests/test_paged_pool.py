"""The paged KV pool: block accounting, addressing, sizing by a memory budget, and preemption.

Outputs under a pool too small for every running sequence (so that the scheduler preempts and later
recomputes sequences) equal the outputs with a pool that holds them all: greedy float64 tiny models
with and without speculation, and seeded sampling.
"""

import pytest
import torch
from helpers import build_model

from specdec import LLM, SamplingParams
from specdec.errors import SpecDecError
from specdec.models.base import ForwardBatch
from specdec.models.kv_budget import parse_memory
from specdec.models.kv_pool import BLOCK_SIZE, KVPoolExhausted

PROMPTS = [[3, 5, 7, 3, 5, 7, 11, 3, 5], [42, 1, 17, 29, 8, 64, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
           [90, 91, 90, 91, 90], [33, 3, 33, 3, 33, 3, 60, 61], [55, 44, 33, 22, 11, 0, 12, 23]]


@pytest.fixture(scope="module")
def target():
    return build_model("llama", seed=101)


def _llm(model, **kwargs) -> LLM:
    return LLM(model, dtype="float64", backend="fast", max_model_len=128, enable_prefix_caching=False, **kwargs)


def test_blocks_are_taken_as_a_slot_grows_and_freed_by_rollback(target):
    llm = _llm(target, max_num_seqs=2)
    fast, pool = llm.target, llm.engine.cache
    assert pool.num_blocks == 2 * (128 // BLOCK_SIZE) and pool.num_free_blocks == pool.num_blocks
    fast.forward(ForwardBatch.from_rows([list(range(1, 21))], [0], [1], fast.device, logits="none"), pool)
    assert pool.lengths[1] == 20 and len(pool.tables[1]) == 2 and pool.num_used_blocks == 2
    pool.set_length(1, 16)  # exactly one full block: the second is freed whole
    assert pool.tables[1] == pool.tables[1][:1] and pool.num_used_blocks == 1
    pool.release(1)
    assert pool.num_used_blocks == 0 and pool.tables[1] == []


def test_scattered_blocks_read_as_consecutive_ones(target):
    """A slot whose blocks are not consecutive (taken while another slot grew) gives the same logits as
    one whose blocks are: reads and writes go through the block table."""
    llm = _llm(target, max_num_seqs=2)
    fast, pool = llm.target, llm.engine.cache
    tokens = [int(t) for t in torch.randint(1, 90, (40,), generator=torch.Generator().manual_seed(0))]

    def run(slot: int) -> torch.Tensor:
        out = []
        for i, t in enumerate(tokens):
            batch = ForwardBatch.from_rows([[t]], [i], [slot], fast.device)
            out.append(fast.forward(batch, pool).logits)
            if slot == 0:  # interleave the other slot's growth, so that the blocks alternate
                fast.forward(ForwardBatch.from_rows([[t]], [i], [1], fast.device), pool)
        return torch.cat(out)

    scattered = run(0)
    assert pool.tables[0] != list(range(pool.tables[0][0], pool.tables[0][0] + len(pool.tables[0])))
    pool.release(0)
    pool.release(1)
    consecutive = run(1)
    assert pool.tables[1] == list(range(pool.tables[1][0], pool.tables[1][0] + len(pool.tables[1])))
    torch.testing.assert_close(scattered, consecutive, rtol=0, atol=1e-12)


def test_memory_budget_sizes_the_pool(target):
    llm = _llm(target, max_num_seqs=4, kv_cache_memory=_budget(target, 9 * BLOCK_SIZE))
    assert llm.engine.cache.num_blocks == 9
    assert llm.engine.cache.keys[0].shape[0] == 9 * BLOCK_SIZE + 1
    with pytest.raises(SpecDecError, match="fewer than one sequence of max_model_len 128"):
        _llm(target, max_num_seqs=4, kv_cache_memory=_budget(target, 7 * BLOCK_SIZE))


@pytest.mark.parametrize("value", ["4GiB", "512 MiB", "2GB", "1e9", 1 << 20])
def test_memory_sizes_parse(value):
    assert parse_memory(value) > 0
    assert parse_memory("4GiB") == 4 << 30


@pytest.mark.parametrize("value", ["lots", "-1GiB", 0, "4 parsecs", True])
def test_bad_memory_size_is_refused(value):
    with pytest.raises(SpecDecError, match="kv_cache_memory must be a positive size"):
        parse_memory(value)


def test_an_exhausted_pool_raises_a_clear_error(target):
    llm = _llm(target, max_num_seqs=2, kv_cache_memory=_budget(target, 12 * BLOCK_SIZE))
    fast, pool = llm.target, llm.engine.cache
    fast.forward(ForwardBatch.from_rows([[1] * 128], [0], [0], fast.device, logits="none"), pool)
    assert pool.num_free_blocks == 4
    with pytest.raises(KVPoolExhausted, match="4 free blocks"):
        fast.forward(ForwardBatch.from_rows([[1] * 65], [0], [1], fast.device, logits="none"), pool)


def _budget(model, tokens: int) -> int:
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 8 * tokens


def _generate(llm: LLM, params) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


@pytest.mark.parametrize("spec", [None, {"method": "draft_model", "model": "truncated", "num_speculative_tokens": 3},
                                  {"method": "ngram", "num_speculative_tokens": 3}])
def test_preemption_keeps_greedy_outputs(target, model_dirs, spec):
    """Six sequences of up to 13 + 60 tokens in a pool of 160 tokens: sequences are preempted and
    recomputed, and every output equals the one with a pool that holds them all."""
    if spec is not None and spec.get("model") == "truncated":
        spec = {**spec, "model": str(model_dirs["llama"]["truncated"])}
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    roomy = _generate(_llm(target, max_num_seqs=6, speculative_config=spec), params)
    small = _llm(target, max_num_seqs=6, speculative_config=spec, kv_cache_memory=_budget(target, 160))
    assert _generate(small, params) == roomy
    assert small.scheduler.num_preemptions > 0
    assert all(p.num_used_blocks == 0 for p in small.engine.kv_pools())


def test_preemption_keeps_seeded_sampled_outputs(target, model_dirs):
    spec = {"method": "draft_model", "model": str(model_dirs["llama"]["random"]), "num_speculative_tokens": 3}
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=50, seed=7 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    roomy = _generate(_llm(target, max_num_seqs=6, speculative_config=spec), params)
    small = _llm(target, max_num_seqs=6, speculative_config=spec, kv_cache_memory=_budget(target, 160))
    assert _generate(small, params) == roomy
    assert small.scheduler.num_preemptions > 0


def test_a_pool_for_the_concurrency_never_preempts(target):
    """A pool sized for max_num_seqs sequences of max_model_len tokens serves many short requests with
    no preemption (the scheduler admits by free blocks, which always cover the running sequences)."""
    llm = _llm(target, max_num_seqs=4, kv_cache_memory=_budget(target, 4 * 128))
    prompts = [{"prompt_token_ids": [1 + i % 80, 2 + i % 7, 3]} for i in range(40)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert llm.scheduler.num_preemptions == 0
    assert llm.engine.cache.num_used_blocks == 0


def test_preemption_scores_each_prompt_once(target):
    """``prompt_logprobs`` under preemption: a recomputed sequence's prompt is fed again but not scored again, and
    its prompt logprobs equal those of a pool that holds every sequence."""
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, prompt_logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    roomy = _llm(target, max_num_seqs=6).generate(prompts, params)
    small = _llm(target, max_num_seqs=6, kv_cache_memory=_budget(target, 160))
    outputs = small.generate(prompts, params)
    assert small.scheduler.num_preemptions > 0
    for out, reference, prompt in zip(outputs, roomy, PROMPTS):
        assert len(out.prompt_logprobs) == len(prompt)
        assert [None if e is None else {t: lp.logprob for t, lp in e.items()} for e in out.prompt_logprobs] == [
            None if e is None else {t: lp.logprob for t, lp in e.items()} for e in reference.prompt_logprobs]
        assert out.outputs[0].token_ids == reference.outputs[0].token_ids
