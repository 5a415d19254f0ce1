"""Sizing the KV pools from a share of the device's memory (``gpu_memory_utilization``, vLLM's name).

The device's total and in-use memory are pinned (monkeypatched) so that the blocks are known exactly; the
pools then hold what the share leaves after the weights and a step, the draft model's pool is counted in the
share, a share too small for one sequence is refused with its figures, and the outputs are those of the
default pool."""

import pytest
import torch
from helpers import build_model

from specdec import LLM, SamplingParams
from specdec.errors import SpecDecError
from specdec.models import kv_budget
from specdec.models.kv_budget import KVBudget, device_memory, feature_bytes_per_token, step_reserve
from specdec.models.kv_pool import BLOCK_SIZE

GIB = 1 << 30
PROMPTS = [[3, 5, 7, 3, 5, 7, 11, 3, 5], [42, 1, 17, 29, 8, 64, 2], [90, 91, 90, 91, 90]]


@pytest.fixture(scope="module")
def target():
    return build_model("llama", seed=101)


@pytest.fixture
def pinned(monkeypatch):
    """The device has ``total`` bytes, of which this process uses ``in_use``."""
    memory = {"total": 1 * GIB, "in_use": 0}
    monkeypatch.setattr(kv_budget, "device_memory", lambda device: (memory["total"], memory["in_use"]))
    return memory


def _llm(model, **kwargs) -> LLM:
    return LLM(model, dtype="float64", backend="fast", max_model_len=128, **{"max_num_seqs": 2, **kwargs})


def _expected_blocks(llm: LLM, share: float, total: int, in_use: int, draft_per_token: int = 0) -> int:
    rows = llm.max_num_seqs * (llm.engine.k + 1)
    reserve = step_reserve(llm.target, max(llm.max_num_batched_tokens, rows), rows)
    per_token = llm.target.kv_bytes_per_token() * (1 + 1 / llm.target.num_layers) + draft_per_token
    return int((share * total - in_use - reserve) // (per_token * BLOCK_SIZE))


def test_the_share_sizes_the_pool(target, pinned):
    pinned.update(total=64 << 20, in_use=8 << 20)
    llm = _llm(target, gpu_memory_utilization=0.5)
    blocks = _expected_blocks(llm, 0.5, 64 << 20, 8 << 20)
    assert llm.engine.cache.num_blocks == blocks > 2 * 128 // BLOCK_SIZE
    assert llm.engine.cache.keys[0].shape[0] == blocks * BLOCK_SIZE + 1
    assert f"the KV cache holds {blocks * BLOCK_SIZE} tokens" in llm.kv_cache_description
    assert "gpu_memory_utilization 0.5 of 0.06 GiB" in llm.kv_cache_description
    more = _llm(target, gpu_memory_utilization=0.75)  # a larger share, a larger pool
    assert more.engine.cache.num_blocks == _expected_blocks(more, 0.75, 64 << 20, 8 << 20) > blocks


def test_the_draft_models_pool_is_in_the_share(target, model_dirs, pinned):
    """A draft model's pool takes as many blocks as the target's, and both fit the share together."""
    pinned.update(total=64 << 20, in_use=8 << 20)
    spec = {"method": "draft_model", "model": str(model_dirs["llama"]["truncated"]), "num_speculative_tokens": 3}
    llm = _llm(target, gpu_memory_utilization=0.5, speculative_config=spec)
    draft_pool = llm.engine.drafter.kv_pools()[0]
    blocks = _expected_blocks(llm, 0.5, 64 << 20, 8 << 20, draft_pool_bytes_per_token(llm))
    assert llm.engine.cache.num_blocks == draft_pool.num_blocks == blocks
    assert blocks < _expected_blocks(llm, 0.5, 64 << 20, 8 << 20)  # the draft's pool took its part


def draft_pool_bytes_per_token(llm: LLM) -> int:
    return llm.engine.drafter.model.kv_bytes_per_token()


def test_the_features_kept_with_the_blocks_are_in_the_share(target, tmp_path, pinned):
    """With prefix caching, an EAGLE head's target hidden states are kept beside the target's blocks: the share
    covers them (one layer's states a token here), so the pool gets fewer blocks than without them."""
    from test_heads import make_heads

    pinned.update(total=64 << 20, in_use=8 << 20)
    make_heads(target, "eagle", tmp_path / "eagle", seed=4)
    spec = {"method": "eagle", "model": str(tmp_path / "eagle"), "num_speculative_tokens": 2}
    llm = _llm(target, gpu_memory_utilization=0.5, speculative_config=spec)
    states = feature_bytes_per_token(llm.target, len(llm.engine.hidden_layers))
    assert states == len(llm.engine.hidden_layers) * target.config.hidden_size * 8 > 0
    assert llm.engine.cache.num_blocks == _expected_blocks(llm, 0.5, 64 << 20, 8 << 20, states)
    assert llm.engine.cache.num_blocks < _expected_blocks(llm, 0.5, 64 << 20, 8 << 20)
    llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=4))
    rows = llm.engine.features.rows
    assert rows.shape[0] == llm.engine.cache.num_blocks * BLOCK_SIZE
    assert rows[0].numel() * rows.element_size() == states


def test_a_share_past_the_free_memory_says_to_lower_it(target, pinned, monkeypatch):
    pinned.update(total=64 << 20, in_use=8 << 20)
    monkeypatch.setattr(kv_budget, "available_memory", lambda device: 4 << 20)  # others hold the rest
    with pytest.raises(SpecDecError, match=r"the KV cache would take 0\.0\d GiB, but 0\.00 GiB of cpu memory is free "
                                           r"\(other processes hold the rest\) and a pool may take 90% of it; lower "
                                           r"gpu_memory_utilization to at most 0\.1\d$"):
        _llm(target, gpu_memory_utilization=0.5)


def test_outputs_equal_the_default_pools(target, model_dirs, pinned):
    """A pool sized by the share (a small one: sequences are preempted) gives the default pool's tokens."""
    spec = {"method": "draft_model", "model": str(model_dirs["llama"]["truncated"]), "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    default = _llm(target, speculative_config=spec, max_num_seqs=3)
    # A share of 10 blocks (160 tokens) beside nothing in use: one sequence fits, three do not.
    pools = 10 * BLOCK_SIZE * (default.target.kv_bytes_per_token() * (1 + 1 / default.target.num_layers)
                               + draft_pool_bytes_per_token(default))
    reserve = step_reserve(default.target, default.max_num_batched_tokens, 3 * 4)
    pinned.update(total=int(2 * (pools + reserve)) + 1, in_use=0)
    small = _llm(target, speculative_config=spec, max_num_seqs=3, gpu_memory_utilization=0.5)
    assert small.engine.cache.num_blocks == 10
    assert ([o.outputs[0].token_ids for o in small.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in default.generate(prompts, params)])
    assert small.scheduler.num_preemptions > 0


def test_a_share_too_small_for_one_sequence_is_refused(target, pinned):
    pinned.update(total=64 << 20, in_use=32 << 20)
    with pytest.raises(SpecDecError, match=r"gpu_memory_utilization 0\.5 of 0\.06 GiB is 0\.03 GiB, less 0\.03 GiB "
                                           r"in use .* room for 0 tokens, fewer than one sequence of max_model_len "
                                           r"128; raise gpu_memory_utilization"):
        _llm(target, gpu_memory_utilization=0.5)


@pytest.mark.parametrize("value", [0, -0.1, 1.5, True, "0.9", float("nan")])
def test_bad_shares_are_refused_before_loading(value):
    with pytest.raises(SpecDecError, match="gpu_memory_utilization must be a fraction in \\(0, 1\\]"):
        LLM("/no/such/model", gpu_memory_utilization=value)


def test_a_size_and_a_share_are_not_both_given():
    with pytest.raises(SpecDecError, match="give kv_cache_memory .* or gpu_memory_utilization .*, not both"):
        LLM("/no/such/model", kv_cache_memory="1GiB", gpu_memory_utilization=0.5)


@pytest.mark.parametrize("sizing", [{"gpu_memory_utilization": 0.5}, {"kv_cache_memory": "1GiB"}])
def test_a_backend_that_does_not_page_refuses_a_size(target, pinned, sizing):
    """transformers' forward grows a cache per sequence: a size or share asked for would not bound it."""
    (name,) = sizing
    with pytest.raises(SpecDecError, match=f"{name} sizes the fast backend's paged KV pool, and .* runs on "
                                           "transformers' forward, whose caches grow per sequence"):
        LLM(target, dtype="float64", backend="hf", max_model_len=128, max_num_seqs=2, **sizing)
    llm = LLM(target, dtype="float64", backend="hf", max_model_len=128, max_num_seqs=2)
    assert llm.kv_cache_description is None and llm.engine.cache.num_blocks == 0


def test_the_budget_is_fixed_by_its_first_call(target, pinned):
    llm = _llm(target)
    budget = KVBudget(llm.target, 128, gpu_memory_utilization=0.5)
    pinned.update(total=64 << 20)
    first = budget.blocks(extra_bytes_per_token=100)
    pinned.update(total=1 << 40)
    assert budget.blocks() == first


def test_this_machines_memory_is_read():
    total, in_use = device_memory(torch.device("cpu"))
    assert total > in_use > 0


def test_the_pool_is_described_however_it_was_sized(target):
    """``kv_cache_description`` says how the target's pool was sized: room for every slot full by default, or the
    tokens a ``kv_cache_memory`` size holds (the share's own line is checked above); None on transformers' forward."""
    default = LLM(target, dtype="float64", backend="fast", max_model_len=100, max_num_seqs=3)
    blocks = 3 * -(-100 // BLOCK_SIZE)
    assert default.engine.cache.num_blocks == blocks
    assert default.kv_cache_description.startswith(
        f"the KV cache holds {blocks * BLOCK_SIZE} tokens ({blocks} blocks of {BLOCK_SIZE}, ")
    assert "room for max_num_seqs 3 sequences of max_model_len 100" in default.kv_cache_description
    sized = _llm(target, kv_cache_memory="1MiB")
    tokens = (1 << 20) // (sized.target.kv_bytes_per_token() * BLOCK_SIZE) * BLOCK_SIZE
    assert sized.kv_cache_description.startswith(f"kv_cache_memory 1MiB: the KV cache holds {tokens} tokens")
    assert LLM(target, dtype="float64", backend="hf", max_model_len=128).kv_cache_description is None
