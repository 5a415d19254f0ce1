"""Speculative decoding on every fast family, end to end, float64.

- Greedy: plain decoding, a draft model (the target's first layer), n-gram chains and n-gram trees
  (``num_candidates = 2``), each over the nine prompts of test_greedy_equality in one batch (lengths 1
  to 17, up to 40 new tokens: every windowed family's window of 6 is crossed), equal transformers'
  greedy ``generate`` of each prompt alone, token for token.
- Sampling: Gemma 2 (attention and final soft-capping, sandwich norms, a window of 2 crossed inside the
  prompt) with a draft model follows its exact distribution (the chi-square test of
  test_sampling_exactness).
"""

import pytest
import torch
from helpers import FAMILY_ARCHS, build_model, truncated_copy
from test_greedy_equality import check_outputs, greedy_references, run_batch
from test_sampling_exactness import BATCH, PROMPT, SETTINGS, VOCAB, assert_matches_target, exact_joint
from transformers import Gemma2Config, Gemma2ForCausalLM

from specdec import LLM, SamplingParams
from specdec.models.fast_llama import FastLlamaLM

FAMILIES = list(FAMILY_ARCHS)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """Per family: ``target`` (3 layers) and ``truncated`` (its first layer) folders."""
    root = tmp_path_factory.mktemp("families")
    dirs = {}
    for index, arch in enumerate(FAMILIES):
        target = build_model(arch, seed=300 + index)
        dirs[arch] = {"target": root / arch / "target", "truncated": root / arch / "truncated"}
        target.save_pretrained(dirs[arch]["target"])
        truncated_copy(target, keep_layers=1).save_pretrained(dirs[arch]["truncated"])
    return dirs


@pytest.fixture(scope="module")
def family_refs(family_dirs):
    """transformers' greedy continuation of each prompt alone, per family."""
    return greedy_references(family_dirs, experts_implementation="eager")


METHODS = {
    "plain": None,
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
    "ngram_tree": {"method": "ngram", "num_speculative_tokens": 4, "num_candidates": 2, "prompt_lookup_max": 3,
                   "prompt_lookup_min": 1},
}


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("arch", FAMILIES)
def test_batched_greedy_matches_transformers(family_dirs, family_refs, arch, method):
    spec = METHODS[method]
    if method == "draft_model":
        spec = {**spec, "model": str(family_dirs[arch]["truncated"])}
    llm = LLM(family_dirs[arch]["target"], speculative_config=spec, dtype="float64", max_num_seqs=5)
    assert isinstance(llm.target, FastLlamaLM)
    check_outputs(run_batch(llm), family_refs[arch])
    metrics = llm.batch_metrics
    if method != "plain":
        assert metrics.num_accepted_tokens > 0 and metrics.num_draft_tokens > metrics.num_accepted_tokens
    assert max(llm.engine.cache.lengths) == 0 and not llm.scheduler.has_work


@pytest.fixture(scope="module")
def gemma_pair(tmp_path_factory):
    """A Gemma 2 target and draft of ``VOCAB`` tokens, weights x3 and the (tied) embeddings x5 (peaked
    distributions, logits of about 5 that the final soft-cap of 4 bends), window 2."""
    root = tmp_path_factory.mktemp("gemma_exact")
    for name, seed, layers in (("target", 11, 2), ("draft", 12, 1)):
        torch.manual_seed(seed)
        config = Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=12,
                              sliding_window=2, attn_logit_softcapping=1.0, final_logit_softcapping=4.0,
                              max_position_embeddings=64, eos_token_id=None, bos_token_id=None, pad_token_id=None)
        model = Gemma2ForCausalLM(config).to(torch.float64).eval()
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(3.0)
            model.model.embed_tokens.weight.mul_(5.0)
        model.save_pretrained(root / name)
        if name == "target":
            target = model
    return target, root


def test_gemma2_sampling_matches_target(gemma_pair):
    target, root = gemma_pair
    spec = {"method": "draft_model", "model": str(root / "draft"), "num_speculative_tokens": 2}
    llm = LLM(root / "target", speculative_config=spec, dtype="float64", max_num_seqs=BATCH)
    assert isinstance(llm.target, FastLlamaLM)
    assert_matches_target(target, llm, PROMPT, "gemma2 speculative", (3, 2))


def test_gemma2_soft_capping_moves_the_distribution(gemma_pair):
    """Guard: the sampling test above would see a decoder that skipped the soft-caps (at temperature 1 the
    exact joint distributions with and without them are far apart at 2000 samples)."""
    target, _ = gemma_pair
    uncapped = Gemma2ForCausalLM(target.config.__class__(**{**target.config.to_dict(), "final_logit_softcapping": None,
                                                             "attn_logit_softcapping": None}))
    uncapped.load_state_dict(target.state_dict())
    uncapped = uncapped.to(torch.float64).eval()
    params = SamplingParams(**SETTINGS[0])
    distance = abs(exact_joint(target, PROMPT, params) - exact_joint(uncapped, PROMPT, params)).sum() / 2
    assert distance > 0.1, f"total variation {distance:.3f}"
