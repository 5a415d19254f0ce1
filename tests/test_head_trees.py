"""Tree drafts of the head drafters: medusa's static trees over each head's top-r tokens and eagle's
EAGLE-2 dynamic trees. Greedy output equals transformers' greedy generate (batched), sampled output
matches the target distribution (chi-square), and after tree steps with rejections eagle's KV pool
gives the same trees as a fresh drafter prefilled with the whole context."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_greedy_equality import PROMPTS, check_outputs, run_batch
from test_heads import llama, make_heads, references, sharp_pair  # noqa: F401 - fixtures
from test_sampling_exactness import BATCH, PROMPT, assert_matches_target

from specdec import LLM, SamplingParams
from specdec.drafters.heads.eagle import tree_levels
from specdec.drafters.heads.medusa import default_paths
from specdec.errors import SpecDecError
from specdec.tree import DynamicTree, StaticTree, expand, prune

TREE_METHODS = ["medusa", "eagle"]


def test_default_paths_are_best_first_trees():
    paths = default_paths(12, 3, 4)
    assert paths[:4] == ((0,), (0, 0), (1,), (0, 0, 0))
    for n in range(1, len(paths) + 1):  # every prefix is a tree
        StaticTree.from_paths(paths[:n])
    assert len(default_paths(100, 2, 3)) == 2 + 4 + 8  # all there are
    assert all(len(p) <= 3 and max(p) < 2 for p in default_paths(100, 2, 3))


@pytest.mark.parametrize(("candidates", "k"), [(2, 4), (3, 9)])
@pytest.mark.parametrize("method", TREE_METHODS)
def test_head_trees_batched_greedy_match_transformers(model_dirs, llama, references, tmp_path, method,  # noqa: F811
                                                      candidates, k):
    make_heads(llama, method, tmp_path / method, seed=1)
    spec = {"method": method, "model": str(tmp_path / method), "num_speculative_tokens": k,
            "num_candidates": candidates}
    llm = LLM(model_dirs["llama"]["target"], speculative_config=spec, dtype="float64", max_num_seqs=BATCH)
    check_outputs(run_batch(llm), references)
    metrics = llm.batch_metrics
    assert metrics.num_draft_tokens > 50 and metrics.num_accepted_tokens > 0
    assert max(llm.engine.cache.lengths) == 0 and not llm.scheduler.has_work


@pytest.mark.parametrize("method", TREE_METHODS)
def test_head_trees_sampling_matches_target(sharp_pair, method):  # noqa: F811
    target, root = sharp_pair
    make_heads(target, method, root / f"{method}_tree", seed=4, scale=3.0, num_heads=2)
    spec = {"method": method, "model": str(root / f"{method}_tree"), "num_speculative_tokens": 3,
            "num_candidates": 2}
    llm = LLM(root / "target", speculative_config=spec, dtype="float64", max_num_seqs=BATCH)
    assert_matches_target(target, llm, PROMPT, f"{method} tree")


def brute_force_tree(module, target, context: tuple[int, ...], k: int, r: int) -> tuple[list[int], list[int]]:
    """EAGLE-2's tree for ``context`` with the layer run by transformers over each node's whole sequence:
    the target's features of the context, then the predicted features along the node's path."""
    ids = torch.tensor([context])
    feats = target(ids, output_hidden_states=True).hidden_states[-1]
    head = module.decoder.lm_head.weight

    def predict(path):  # path: [(parent's predicted feature [1, 1, H], token)] -> the feature after it
        inputs = torch.cat([feats[:, :-1], *[f for f, _ in path]], dim=1)
        tokens = torch.cat([ids[:, 1:], torch.tensor([[t for _, t in path]], dtype=torch.long)], dim=1)
        return module(inputs, tokens)[:, -1:]

    paths, predicted = {-1: []}, {-1: predict([])}
    tree, frontier = DynamicTree.empty(1, ids.device, torch.float64), torch.tensor([[-1]])
    logprobs = F.log_softmax(F.linear(predicted[-1], head), dim=-1)  # [1, 1, V]
    levels = tree_levels(k, r)
    for level in range(levels):
        tree, frontier = expand(tree, frontier, logprobs, r, r)
        if level == levels - 1:
            break
        rows = []
        for node in frontier[0].tolist():
            parent = int(tree.parents[0, node])
            paths[node] = [*paths[parent], (predicted[parent], int(tree.tokens[0, node]))]
            predicted[node] = predict(paths[node])
            rows.append(F.log_softmax(F.linear(predicted[node], head), dim=-1)[0, 0])
        logprobs = torch.stack(rows)[None]
    tokens, parents, _ = prune(tree, [k])
    return tokens[0].tolist(), parents[0].tolist()


def _recorder(llm, k: int, records: dict, first_step_only: bool = False):
    """Wrap eagle's ``propose``: per full-budget row, its context -> (tree tokens, parents, its pool entries);
    ``first_step_only``: only each sequence's first step (prompts fed in chunks start on different steps)."""
    drafter = llm.engine.drafter
    propose, started = drafter.propose, set()

    def recording(seqs, ks, sampling):
        draft = propose(seqs, ks, sampling)
        pool = drafter.cache
        for b, s in enumerate(seqs):
            first = s.request_id not in started
            started.add(s.request_id)
            if first_step_only and not first:
                continue
            n = draft.num_draft[b]
            if ks[b] != k or n == 0:
                continue
            length = pool.lengths[s.slot]
            rows = pool.rows_of(s.slot, 0, length)  # through the slot's block table
            entries = torch.cat([part[rows] for part in (*pool.keys, *pool.values)])
            records[tuple(s.token_ids)] = (draft.tokens[b, :n].tolist(), draft.parents[b, :n].tolist(), entries.clone())
        return draft

    drafter.propose = recording


def test_eagle_tree_state_equals_a_fresh_computation(model_dirs, llama, tmp_path):  # noqa: F811
    """After tree steps with rejections, eagle's KV pool and its next tree equal those of a fresh drafter
    prefilled with the same context (the pool keeps only target-feature pairs; drafted nodes are dropped)."""
    module = make_heads(llama, "eagle", tmp_path / "eagle", seed=3, scale=3.0)
    k = 6
    spec = {"method": "eagle", "model": str(tmp_path / "eagle"), "num_speculative_tokens": k, "num_candidates": 2}
    llm = LLM(model_dirs["llama"]["target"], speculative_config=spec, dtype="float64", max_num_seqs=4)
    seen: dict = {}
    _recorder(llm, k, seen)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], SamplingParams(temperature=0, max_tokens=24))
    metrics = llm.batch_metrics
    assert metrics.num_accepted_tokens < metrics.num_draft_tokens - 2 * metrics.num_steps, "needs rejections"
    later = {c: v for c, v in seen.items() if not any(c == tuple(p) for p in PROMPTS)}
    assert len(later) > 10 and any(max(parents) > 0 and len(set(parents)) < len(parents)
                                   for _, parents, _ in later.values()), "needs branching trees after steps"
    fresh = LLM(model_dirs["llama"]["target"], speculative_config=spec, dtype="float64", max_num_seqs=len(later))
    again: dict = {}
    _recorder(fresh, k, again, first_step_only=True)
    fresh.generate([{"prompt_token_ids": list(c)} for c in later], SamplingParams(temperature=0, max_tokens=k + 2))
    assert set(again) == set(later)
    for context, (tokens, parents, entries) in later.items():
        assert (tokens, parents) == again[context][:2], f"context {context}"
        torch.testing.assert_close(entries, again[context][2], rtol=1e-9, atol=1e-9)
    with torch.no_grad():
        for context in list(later)[::3]:
            assert brute_force_tree(module, llama, context, k, 2) == later[context][:2], f"context {context}"


def test_head_trees_need_the_fast_backend(model_dirs, llama, tmp_path):  # noqa: F811
    make_heads(llama, "medusa", tmp_path / "medusa", seed=5)
    spec = {"method": "medusa", "model": str(tmp_path / "medusa"), "num_candidates": 2}
    with pytest.raises(SpecDecError, match="medusa with num_candidates > 1 proposes trees"):
        LLM(model_dirs["llama"]["target"], speculative_config=spec, dtype="float64", backend="hf")
    with pytest.raises(SpecDecError, match="'mtp' does not choose among several candidates"):
        LLM(model_dirs["llama"]["target"], speculative_config={"method": "mtp", "num_candidates": 2}, dtype="float64")


@pytest.mark.parametrize("method", TREE_METHODS)
def test_trees_at_the_end_of_the_context_in_a_batch(model_dirs, llama, tmp_path, method):  # noqa: F811
    """Rows of one batch reach ``max_model_len`` at different steps, the others still drafting trees of the full
    budget: every row ends at the context's end with plain decoding's greedy tokens (eagle's tree expansions
    once wrote a whole budget into the layer's pool of a row with fewer positions left, and failed the batch)."""
    make_heads(llama, method, tmp_path / method, seed=1)
    spec = {"method": method, "model": str(tmp_path / method), "num_speculative_tokens": 8, "num_candidates": 2}
    max_model_len = 64
    prompts = [[(7 * i + 3 * n) % 90 + 1 for i in range(n)] for n in (30, 40, 50, 55)]
    params = SamplingParams(temperature=0, max_tokens=32)
    plain = LLM(model_dirs["llama"]["target"], dtype="float64", max_model_len=max_model_len, max_num_seqs=4)
    llm = LLM(model_dirs["llama"]["target"], speculative_config=spec, dtype="float64", max_model_len=max_model_len,
              max_num_seqs=4)
    expected = plain.generate([{"prompt_token_ids": p} for p in prompts], params)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, want, got in zip(prompts, expected, outputs, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert len(prompt) + len(got.outputs[0].token_ids) == min(max_model_len, len(prompt) + 32)
    assert llm.batch_metrics.num_draft_tokens > 0
