"""The suffix drafter: lossless greedy output in batches, the shared cache's cap and invariants,
and its proposal rule."""

import random

import pytest
import torch
from helpers import build_model
from transformers import AutoModelForCausalLM

from specdec import LLM, SamplingParams, SpecDecError
from specdec.bench.workloads import Question, repeat_with_changes
from specdec.drafters.suffix_index import MAX_MATCH, Candidate, TokenIndex, propose

PROMPTS = [[3, 5, 7, 3, 5, 7, 11, 3, 5], [42, 1, 17, 29, 8, 64, 2], [7], [10, 20], [60, 5, 60, 6],
           [55, 44, 33, 22, 11, 0, 12, 23, 34]]
MAX_TOKENS = [30, 24, 31, 12, 17, 28]


def reference(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch,backend", [("llama", "fast"), ("gpt2", "hf")])
def test_suffix_greedy_matches_transformers_and_learns_across_requests(model_dirs, arch, backend):
    """Three generate calls on one LLM (3 slots, so requests queue and finish mid-batch): the first
    mixes the prompts, the second repeats them (the shared cache knows their outputs), the third
    mixes repeated and new prompts. Every output equals transformers' greedy output."""
    target = AutoModelForCausalLM.from_pretrained(model_dirs[arch]["target"], dtype=torch.float64)
    refs = [reference(target, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    llm = LLM(model_dirs[arch]["target"], speculative_config={"method": "suffix", "num_speculative_tokens": 5},
              dtype="float64", backend=backend, max_num_seqs=3)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]

    def run(indices):
        outputs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in indices], [params[i] for i in indices])
        for i, out in zip(indices, outputs):
            assert out.outputs[0].token_ids == refs[i]
        return outputs

    first = run(range(len(PROMPTS)))
    again = run(range(len(PROMPTS)))
    mixed = run([5, 0, 2, 3])
    assert sum(o.metrics.num_accepted_tokens for o in again) > sum(o.metrics.num_accepted_tokens for o in first)
    for out in again:
        # Its own earlier output is in the shared cache: nearly every draft is accepted.
        assert out.metrics.acceptance_rate > 0.8
        assert out.metrics.mean_acceptance_length > 3
    assert all(o.metrics.num_accepted_tokens > 0 for o in mixed)
    assert max(llm.engine.cache.lengths) == 0 and not llm.engine.drafter._own


def test_suffix_cache_stays_under_its_cap(model_dirs):
    """Over many requests the shared cache holds at most ``suffix_cache_max_tokens`` tokens, its
    invariants hold after every eviction, and evicted requests are no longer proposed."""
    cap = 60
    spec = {"method": "suffix", "num_speculative_tokens": 4, "suffix_cache_max_tokens": cap}
    llm = LLM(model_dirs["llama"]["target"], speculative_config=spec, dtype="float64", max_num_seqs=2)
    drafter = llm.engine.drafter
    rng = random.Random(0)
    for _ in range(12):
        prompts = [[rng.randrange(96) for _ in range(rng.randrange(1, 25))] for _ in range(3)]
        llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=15))
        shared = drafter.shared
        shared.check()
        assert 0 < shared.num_tokens <= cap
        assert len(shared.tokens) <= 2 * (cap + len(shared.docs))
        assert sum(len(chain) for chains in shared.chains.values() for chain in chains.values()) <= 3 * cap
    assert len(shared.docs) < 36 // 2, "the test must evict"


def test_eviction_forgets_the_oldest_documents():
    index = TokenIndex()
    index.add([1, 2, 3, 4, 5, 6])
    index.add([7, 8, 9])
    assert index.candidates([0, 2, 3, 4], 3) == [Candidate(3, [5, 6])]
    index.evict_oldest()
    index.check()
    assert index.candidates([0, 2, 3, 4], 3) == []
    assert index.candidates([7, 8], 3) == [Candidate(2, [9])]
    index.add([2, 3, 4, 0])
    index.check()
    assert index.candidates([9, 2, 3, 4], 3) == [Candidate(3, [0])]


def test_open_document_grows_and_matches_stop_at_documents():
    index = TokenIndex()
    index.add([5, 6, 7])
    index.extend([6])
    index.extend([9, 4])
    index.check()
    # [7, 6] spans the two documents: the separator between them stops the match at one token.
    found = index.candidates([7, 6], 4)
    assert found == [Candidate(1, [9, 4]), Candidate(1, [7])]
    assert propose(found, 4, 1.0, 0.1) == [9]
    assert index.candidates([5, 6, 9], 4) == [Candidate(2, [4])]


def test_propose_prefers_the_longest_match_then_the_most_frequent_continuation():
    found = [Candidate(2, [1, 2, 3]), Candidate(4, [7, 8, 9]), Candidate(4, [5, 6]), Candidate(4, [5, 6, 1])]
    assert propose(found, 8, 1.0, 0.1) == [5, 6, 1]
    assert propose(found, 2, 1.0, 0.1) == [5, 6]
    # min_prob: the third token is backed by 1 of the 3 longest matches.
    assert propose(found, 8, 1.0, 0.5) == [5, 6]
    # Ties go to the most recent (first) candidate.
    assert propose([Candidate(3, [4]), Candidate(3, [9])], 4, 1.0, 0.1) == [4]


def test_draft_length_grows_with_match_length_and_frequency():
    long_tail = list(range(20))
    assert len(propose([Candidate(1, long_tail)], 16, 1.0, 0.1)) == 1
    assert len(propose([Candidate(5, long_tail)], 16, 1.0, 0.1)) == 5
    assert len(propose([Candidate(1, long_tail)] * 4, 16, 1.0, 0.1)) == 3  # 1 x (1 + log2 4)
    assert len(propose([Candidate(MAX_MATCH, long_tail)], 16, 1.0, 0.1)) == 16
    assert len(propose([Candidate(5, long_tail)], 16, 2.0, 0.1)) == 10


@pytest.mark.parametrize("field,value", [
    ("suffix_cache_max_tokens", -1), ("suffix_cache_max_tokens", 1.5), ("suffix_factor", 0),
    ("suffix_min_prob", 1.5), ("suffix_min_prob", True), ("model", "somewhere"),
])
def test_bad_suffix_config(model_dirs, field, value):
    with pytest.raises(SpecDecError, match=field):
        LLM(model_dirs["llama"]["target"], speculative_config={"method": "suffix", field: value}, dtype="float64")


def test_repeated_workload_asks_each_prompt_again_changed():
    questions = [Question("code-0", "code", ("def call(x):\n    pass\n",), "code"),
                 Question("code-1", "code", ("x = 1\n",), "code")]
    out = repeat_with_changes(questions)
    assert [q.category for q in out] == ["code", "code", "code_again", "code_again"]
    assert out[2].turns == ("def call_v2(x):\n    pass\n",)
    assert out[3].turns == ("# again\nx = 1\n",)


def test_bench_runner_forgets_the_warm_up(model_dirs):
    from specdec.bench.methods import MethodSpec
    from specdec.bench.runners import SpecDecRunner

    model = build_model("llama", seed=3)
    llm = LLM(model, speculative_config={"method": "suffix", "num_speculative_tokens": 3}, dtype="float64")
    runner = SpecDecRunner(MethodSpec("suffix", 3), llm)
    runner.run([[1, 2, 3]], 8, 0.0, 0)
    assert llm.engine.drafter.shared.num_tokens == 11
    runner.forget()
    assert llm.engine.drafter.shared.num_tokens == 0


def test_bench_repeats_measure_what_the_first_pass_did():
    """With --repeats the suffix cache forgets before each pass: the second repeat drafts and keeps
    exactly what the first did (greedy, float64), not the answers it saw in the first."""
    from specdec.bench.harness import BenchSettings, run_benchmark
    from specdec.bench.methods import MethodSpec
    from specdec.bench.runners import SpecDecRunner

    class Prompts:
        def build(self, turns, answers):
            return [3 + len(t) for t in turns]

        def decode(self, token_ids):
            return "x" * len(token_ids)

    model = build_model("llama", seed=3)
    runners = [SpecDecRunner(MethodSpec("plain"), LLM(model, dtype="float64")),
               SpecDecRunner(MethodSpec("suffix", 3), LLM(model, dtype="float64",
                             speculative_config={"method": "suffix", "num_speculative_tokens": 3}))]
    questions = [Question(str(i), "code", ("a" * (i + 1),), "code") for i in range(3)]
    settings = BenchSettings(max_tokens=24, repeats=2, warmup=0)
    result = run_benchmark(runners, questions, Prompts(), settings, progress=False)
    suffix = [m for m in result.measurements if m.method == "suffix k=3"]
    kept = {r: [m.metrics.num_accepted_tokens for m in suffix if m.repeat == r] for r in (0, 1)}
    assert kept[0] == kept[1] and sum(kept[0]) > 0
    assert result.mismatches == {}
