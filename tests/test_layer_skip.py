"""Self-speculation by layer skipping: lossless greedy output in batches, the target's pool after
rejections equals a fresh prefill (the draft's reused entries are the target's own), bad input."""

import pytest
import torch
from helpers import make_sequence
from transformers import AutoModelForCausalLM

from specdec import LLM, SamplingParams, SpecDecError
from specdec.drafters.layer_skip import candidate_skip_sets
from specdec.models.base import ForwardBatch

PROMPTS = [[3, 5, 7, 3, 5, 7, 11, 3, 5], [42, 1, 17, 29, 8, 64, 2], [7], [10, 20],
           [55, 44, 33, 22, 11, 0, 12, 23, 34, 45, 56, 67, 78]]
MAX_TOKENS = [30, 24, 31, 12, 20]


def reference(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("skip", [None, [2], [1], [0, 2]])
def test_layer_skip_greedy_matches_transformers(model_dirs, arch, skip):
    """Greedy rows (in a queue of 3 slots, beside sampled rows) give transformers' greedy output."""
    path = model_dirs[arch]["target"]
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    spec = {"method": "layer_skip", "num_speculative_tokens": 3, "skip_layers": skip}
    llm = LLM(path, speculative_config=spec, dtype="float64", max_num_seqs=3)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    sampled = SamplingParams(temperature=0.8, max_tokens=10, seed=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in [*PROMPTS, [9, 9]]], [*params, sampled])
    for prompt, n, out in zip(PROMPTS, MAX_TOKENS, outputs):
        assert out.outputs[0].token_ids == reference(target, prompt, n)
    assert len(outputs[-1].outputs[0].token_ids) == 10
    assert 0 < llm.batch_metrics.num_accepted_tokens < llm.batch_metrics.num_draft_tokens
    drafter = llm.engine.drafter
    if skip is None:
        assert drafter.skip in candidate_skip_sets(3) and set(drafter.calibration) == set(candidate_skip_sets(3))
    assert max(llm.engine.cache.lengths) == 0


def run_ragged_steps(llm, need_rejections=True):
    seqs = [make_sequence(str(i), p, SamplingParams(temperature=t, max_tokens=100), seed=i)
            for i, (p, t) in enumerate(zip(PROMPTS[:4], [0.0, 0.9, 0.0, 1.2]))]
    for seq in seqs:
        llm.scheduler.add(seq)
    rejected = set()
    for _ in range(8):
        outputs = llm.scheduler.step()
        rejected |= {o.request_id for o in outputs if o.num_accepted < o.num_drafted}
    assert len(rejected) >= 2 or not need_rejections, "the test needs rejections in several rows"
    return seqs


def assert_pool_is_a_fresh_prefill(llm, seqs):
    """Every layer's keys and values of every slot equal a fresh prefill of its committed tokens."""
    target, cache = llm.engine.target, llm.engine.cache
    for seq in seqs:
        length = len(seq.token_ids) - 1
        assert cache.lengths[seq.slot] == length
        fresh = target.new_cache(1, length + 1)
        target.forward(ForwardBatch.from_rows([seq.token_ids[:-1]], [0], [0], target.device, logits="none"), fresh)
        for layer in range(target.num_layers):
            for ours, theirs in ((cache.keys, fresh.keys), (cache.values, fresh.values)):
                torch.testing.assert_close(ours[layer][cache.rows_of(seq.slot, 0, length)],
                                           theirs[layer][fresh.rows_of(0, 0, length)], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("skip", [[2], [1, 2]])
def test_reused_draft_entries_leave_the_pool_a_fresh_prefill(model_dirs, skip):
    """Greedy and sampled rows, rejections in most: the entries the draft wrote for the reused
    layers (before the first skipped one) are the target's own, and verification ran only the rest."""
    llm = LLM(model_dirs["llama"]["target"], speculative_config={
        "method": "layer_skip", "num_speculative_tokens": 4, "skip_layers": skip}, dtype="float64", max_num_seqs=5)
    target = llm.engine.target
    verified = []
    forward = target.forward

    def recording(batch, cache):
        if batch.input_hidden is not None:
            verified.append(batch.layers)
        return forward(batch, cache)

    target.forward = recording
    seqs = run_ragged_steps(llm)
    assert verified and all(layers == tuple(range(min(skip), 3)) for layers in verified)
    assert_pool_is_a_fresh_prefill(llm, seqs)


def test_claiming_one_layer_too_many_is_caught(model_dirs):
    """Guard: verification that skips the first skipped layer too (its entries are the draft's)
    leaves a pool that differs from a fresh prefill."""
    llm = LLM(model_dirs["llama"]["target"], speculative_config={
        "method": "layer_skip", "num_speculative_tokens": 4, "skip_layers": [1]}, dtype="float64", max_num_seqs=5)
    drafter = llm.engine.drafter
    drafter.remaining = drafter.remaining[1:]
    seqs = run_ragged_steps(llm, need_rejections=False)
    with pytest.raises(AssertionError):
        assert_pool_is_a_fresh_prefill(llm, seqs)


@pytest.mark.parametrize("spec,message", [
    ({"skip_layers": []}, "skip_layers"),
    ({"skip_layers": [1, 1]}, "skip_layers"),
    ({"skip_layers": [-1]}, "skip_layers"),
    ({"skip_layers": [3]}, "skip_layers"),
    ({"skip_layers": [0, 1, 2]}, "at least one"),
    ({"model": "x"}, "not a folder of heads"),
])
def test_bad_layer_skip_config(model_dirs, spec, message):
    with pytest.raises(SpecDecError, match=message):
        LLM(model_dirs["llama"]["target"], speculative_config={"method": "layer_skip", **spec}, dtype="float64")


def test_layer_skip_needs_the_fast_backend(model_dirs):
    with pytest.raises(SpecDecError, match="fast backend"):
        LLM(model_dirs["gpt2"]["target"], speculative_config={"method": "layer_skip"}, dtype="float64")
