"""Tree-shaped suffix proposals (``num_candidates > 1``): the tree rule and its invariants, lossless
greedy output of batched tree steps across requests, and sampled output that follows the target."""

import random

import pytest
import torch
from test_sampling_exactness import BATCH, assert_matches_target, pair  # noqa: F401  (pair: a fixture)
from test_suffix import MAX_TOKENS, PROMPTS, reference
from test_tree_engine import TREE_PROMPT
from transformers import AutoModelForCausalLM

from specdec import LLM, SamplingParams, SpecDecError
from specdec.drafters.suffix_index import Candidate, propose, propose_tree


def test_tree_takes_the_most_frequent_nodes_first():
    found = [Candidate(2, [5, 6, 1]), Candidate(2, [5, 6, 2]), Candidate(2, [5, 7]), Candidate(1, [9])]
    # Depth 3 (count 1) is beyond factor 1 x match 2 x (1 + log2 1); the shorter match does not vote.
    assert propose_tree(found, 8, 1.0, 0.1, 2) == ([5, 6, 7], [-1, 0, 0])
    assert propose_tree(found, 8, 2.0, 0.1, 2) == ([5, 6, 7, 1, 2], [-1, 0, 0, 1, 1])
    assert propose_tree(found, 4, 2.0, 0.1, 2) == ([5, 6, 7, 1], [-1, 0, 0, 1])
    # min_prob 0.5: 7 (1 of 3 voters) and the depth-3 tokens are out.
    assert propose_tree(found, 8, 2.0, 0.5, 2) == ([5, 6], [-1, 0])
    assert propose_tree(found, 8, 2.0, 0.1, 1) == ([5, 6, 1], [-1, 0, 1])
    assert propose_tree([], 8, 1.0, 0.1, 2) == ([], [])


def test_random_trees_keep_their_invariants():
    """Parents before children, distinct siblings (at most ``width``, most frequent first), at most
    ``budget`` nodes, every node's path followed the match somewhere, and width 1 is the chain."""
    rng = random.Random(0)
    for _ in range(300):
        found = [Candidate(rng.randint(1, 4), [rng.randint(0, 3) for _ in range(rng.randint(0, 6))])
                 for _ in range(rng.randint(1, 12))]
        budget, width = rng.randint(1, 10), rng.randint(1, 4)
        factor, min_prob = rng.choice([0.5, 1.0, 3.0]), rng.choice([0.0, 0.1, 0.4])
        tokens, parents = propose_tree(found, budget, factor, min_prob, width)
        assert len(tokens) == len(parents) <= budget
        match = max(c.match for c in found)
        voters = [c.continuation for c in found if c.match == match]
        paths: list[list[int]] = []
        for i, (token, parent) in enumerate(zip(tokens, parents)):
            assert -1 <= parent < i
            path = (paths[parent] if parent >= 0 else []) + [token]
            paths.append(path)
            assert any(v[: len(path)] == path for v in voters)
        for parent in {-1, *range(len(tokens))}:
            children = [tokens[i] for i, p in enumerate(parents) if p == parent]
            assert len(children) == len(set(children)) <= width
            prefix = paths[parent] if parent >= 0 else []
            counts = [sum(v[: len(prefix) + 1] == prefix + [c] for v in voters) for c in children]
            assert counts == sorted(counts, reverse=True)
        assert propose_tree(found, budget, factor, min_prob, 1)[0] == propose(found, budget, factor, min_prob)


@pytest.mark.parametrize("candidates,k", [(2, 6), (3, 8)])
def test_suffix_trees_greedy_match_transformers(model_dirs, candidates, k):
    """Greedy tree steps (3 slots, requests queueing), the prompts asked twice so that the second round
    drafts from the first one's outputs: every output equals transformers' greedy output, and some
    steps proposed real trees (a node with two children)."""
    target = AutoModelForCausalLM.from_pretrained(model_dirs["llama"]["target"], dtype=torch.float64)
    refs = [reference(target, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    spec = {"method": "suffix", "num_speculative_tokens": k, "num_candidates": candidates}
    llm = LLM(model_dirs["llama"]["target"], speculative_config=spec, dtype="float64", max_num_seqs=3)
    drafter, branched = llm.engine.drafter, []
    propose_batch = drafter.propose

    def recording(seqs, ks, sampling):
        batch = propose_batch(seqs, ks, sampling)
        for row, n in zip(batch.parents.tolist(), batch.num_draft):
            branched.append(len(set(row[:n])) < n)
        return batch

    drafter.propose = recording
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    for _ in range(2):
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert [o.outputs[0].token_ids for o in outputs] == refs
    assert any(branched)
    assert llm.batch_metrics.num_accepted_tokens > 0 and max(llm.engine.cache.lengths) == 0


def test_suffix_trees_need_the_fast_backend(model_dirs):
    with pytest.raises(SpecDecError, match="fast backend"):
        LLM(model_dirs["gpt2"]["target"], speculative_config={"method": "suffix", "num_candidates": 2},
            dtype="float64")


def test_suffix_tree_sampling_matches_target(pair):  # noqa: F811
    """Two siblings after the prompt's suffix ([1, 4] was followed by 3 5 and by 2 9), and whatever the
    earlier (sampled) requests add to the shared cache, in mixed batches: the chi-square test."""
    target, root = pair
    spec = {"method": "suffix", "num_speculative_tokens": 2, "num_candidates": 2}
    llm = LLM(root / "target", speculative_config=spec, dtype="float64", max_num_seqs=BATCH)
    assert_matches_target(target, llm, TREE_PROMPT, "suffix tree")
