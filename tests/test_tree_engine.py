"""The engine's tree step, end to end on float64 tiny models.

- Greedy: ngram trees (several candidate continuations) and random trees from an oracle drafter
  (some branches follow the target's greedy continuation for a while, the others are random),
  batched, equal transformers' greedy ``generate`` token for token.
- Compaction: after every tree step with rejections, each running slot's next-token logits equal
  a fresh transformers forward over its committed tokens.
- Sampling: an ngram tree of two deterministic siblings in mixed batches follows the target's
  distribution (the chi-square test of test_sampling_exactness).
- Bad input: num_candidates out of range, on a chain method, or on a backend without tree masks.
"""

import random

import pytest
import torch
from helpers import make_sequence
from test_greedy_equality import MAX_TOKENS, PROMPTS
from test_sampling_exactness import BATCH, assert_matches_target, pair  # noqa: F401  (pair: a fixture)
from transformers import AutoModelForCausalLM

from specdec import LLM, SamplingParams, SpecDecError
from specdec.drafters.base import DraftBatch, Drafter
from specdec.k_schedule import FixedK
from specdec.models.base import ForwardBatch


@pytest.fixture(scope="module")
def greedy_refs(model_dirs):
    refs = {}
    for arch in ("llama", "qwen2"):
        model = AutoModelForCausalLM.from_pretrained(model_dirs[arch]["target"], dtype=torch.float64)
        refs[arch] = model, []
        for prompt, max_tokens in zip(PROMPTS, MAX_TOKENS):
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            refs[arch][1].append(out[0, len(prompt):].tolist())
    return refs


def run_batch(llm):
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("candidates,k", [(2, 4), (3, 8)])
def test_ngram_tree_greedy_matches_transformers(model_dirs, greedy_refs, arch, candidates, k):
    spec = {"method": "ngram", "num_speculative_tokens": k, "num_candidates": candidates}
    llm = LLM(model_dirs[arch]["target"], dtype="float64", speculative_config=spec, max_num_seqs=4)
    assert run_batch(llm) == greedy_refs[arch][1]
    metrics = llm.batch_metrics
    assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens


class OracleTreeDrafter(Drafter):
    """Random trees of ``ks[b]`` nodes: a node whose path so far is right gets the right next
    token with probability 0.6, every other node a random token (test only, not registered)."""

    method = "oracle_tree"
    description = "test"

    def __init__(self, references: dict[str, list[int]], prompts: dict[str, int], seed: int) -> None:
        self.references, self.prompts, self.rng = references, prompts, random.Random(seed)
        self.paths_seen: list[list[int]] = []

    @classmethod
    def from_config(cls, config, target, options):
        raise NotImplementedError

    def add(self, seqs):
        pass

    def propose(self, seqs, ks, sampling):
        rows = []
        for s, k in zip(seqs, ks):
            right = self.references[s.request_id][len(s.token_ids) - self.prompts[s.request_id]:]
            tokens, parents, on_track = [], [], []
            for i in range(k):
                parent = self.rng.randrange(-1, i)
                depth, good = 0, True
                node = parent
                while node >= 0:
                    depth, good, node = depth + 1, good and on_track[node], parents[node]
                if good and self.rng.random() < 0.6:
                    tokens.append(right[depth])
                    on_track.append(True)
                else:
                    tokens.append(self.rng.randrange(96))
                    on_track.append(tokens[-1] == right[depth] and good)
                parents.append(parent)
            rows.append((tokens, parents))
        return DraftBatch.from_trees(rows, torch.device("cpu"))

    def observe_paths(self, seqs, paths):
        self.paths_seen.extend(paths)

    def observe(self, seqs, num_accepted):
        pass


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_random_trees_greedy_and_compaction(model_dirs, greedy_refs, arch):
    model, refs = greedy_refs[arch]
    llm = LLM(model_dirs[arch]["target"], dtype="float64", max_num_seqs=5)
    engine = llm.engine
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    drafter = OracleTreeDrafter(dict(zip(ids, refs)), {i: len(p) for i, p in zip(ids, PROMPTS)}, seed=7)
    engine.drafter, engine.k, engine.policy = drafter, 6, FixedK(6)
    seqs = [make_sequence(i, p, SamplingParams(temperature=0, max_tokens=n)) for i, p, n in
            zip(ids, PROMPTS, MAX_TOKENS)]
    for s in seqs:
        llm.scheduler.add(s)
    rejected_steps = 0
    while llm.scheduler.has_work:
        outputs = llm.scheduler.step()
        rejected_steps += any(o.num_accepted < o.num_drafted for o in outputs)
        for s in llm.scheduler.running:  # compaction: the cache holds exactly the committed context
            length = engine.cache.lengths[s.slot]
            assert length == len(s.token_ids) - 1
            batch = ForwardBatch.from_rows([s.token_ids[-1:]], [length], [s.slot], torch.device("cpu"))
            logits = engine.target.forward(batch, engine.cache).logits[0]
            engine.cache.set_length(s.slot, length)
            with torch.no_grad():
                fresh = model(torch.tensor([s.token_ids])).logits[0, -1]
            torch.testing.assert_close(logits, fresh, rtol=1e-9, atol=1e-9)
    assert [s.token_ids[len(p):] for s, p in zip(seqs, PROMPTS)] == refs
    assert rejected_steps > 5
    assert any(len(p) >= 2 for p in drafter.paths_seen), "some accepted paths must be deep"
    assert any(p != list(range(len(p))) for p in drafter.paths_seen), "some accepted paths must need compaction"


TREE_PROMPT = [3, 1, 4, 3, 5, 1, 4, 2, 9, 1, 4]  # [1, 4] was followed by 3 5 and by 2 9: two siblings


def test_ngram_tree_sampling_matches_target(pair):  # noqa: F811
    target, root = pair
    spec = {"method": "ngram", "num_speculative_tokens": 2, "num_candidates": 2}
    llm = LLM(root / "target", speculative_config=spec, dtype="float64", max_num_seqs=BATCH)
    assert_matches_target(target, llm, TREE_PROMPT, "tree")


def test_tree_config_errors(model_dirs):
    target = model_dirs["llama"]["target"]
    for bad in (0, 17, True, "2"):
        with pytest.raises(SpecDecError, match="num_candidates must be an integer"):
            LLM(target, speculative_config={"method": "ngram", "num_candidates": bad})
    with pytest.raises(SpecDecError, match="does not choose among several candidates"):
        LLM(target, speculative_config={"method": "draft_model", "model": str(target), "num_candidates": 2})
    with pytest.raises(SpecDecError, match="need the fast backend"):
        LLM(model_dirs["gpt2"]["target"], speculative_config={"method": "ngram", "num_candidates": 2})
