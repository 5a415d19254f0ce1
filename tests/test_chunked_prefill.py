"""Chunked prefill: prompts fed over several steps beside the running sequences' steps, within the
step's token budget, give exactly the outputs of prompts fed whole (greedy and seeded sampling, plain
and every kind of drafter that keeps state from the prompt: draft model, n-gram, suffix, heads), and
the settings are checked."""

import pytest
from helpers import spy
from test_heads import make_heads
from test_prefill_pacer import _Fixed

from specdec import LLM, SamplingParams
from specdec.errors import SpecDecError
from specdec.scheduler import MIN_PREFILL_CHUNK

# Long prompts (several chunks of BUDGET tokens) among short ones; more prompts than slots, so that
# later prompts are fed while earlier ones decode.
PROMPTS = [
    [(7 * i + 3) % 90 + 1 for i in range(70)],
    [5, 9, 13],
    [(11 * i) % 80 + 2 for i in range(45)],
    [(3 * i) % 17 + 20 for i in range(33)],
    [42],
    [(5 * i + 1) % 60 + 3 for i in range(58)],
]
BUDGET = 8
MAX_NUM_SEQS = 3


def spec(model_dirs, method, tmp_path_factory, llama):
    if method == "plain":
        return None
    if method == "draft_model":
        return {"method": "draft_model", "model": str(model_dirs["llama"]["random"]), "num_speculative_tokens": 3}
    if method == "eagle":
        folder = tmp_path_factory.mktemp("eagle_chunked")
        make_heads(llama, "eagle", folder, seed=11, scale=3.0)
        return {"method": "eagle", "model": str(folder), "num_speculative_tokens": 3}
    if method == "ngram_tree":  # trees: the chunks are fed in forwards of their own beside the step
        return {"method": "ngram", "num_speculative_tokens": 3, "num_candidates": 2}
    if method == "layer_skip":  # verification resumes the draft's layers: the same
        return {"method": "layer_skip", "skip_layers": [1], "num_speculative_tokens": 3}
    return {"method": method, "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def llama(model_dirs):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dirs["llama"]["target"], dtype=torch.float64)


def run(model_dirs, config, chunked: bool, params, backend="auto"):
    """Every prompt's tokens, and whether a step fed a prompt chunk while other sequences decoded."""
    llm = LLM(model_dirs["llama"]["target"], speculative_config=config, dtype="float64", max_num_seqs=MAX_NUM_SEQS,
              enable_chunked_prefill=chunked, max_num_batched_tokens=BUDGET if chunked else None, backend=backend)
    requests = [llm.submit({"prompt_token_ids": p}, q) for p, q in zip(PROMPTS, params)]
    tokens = {r.seq.request_id: [] for r in requests}
    beside = False
    scheduler = llm.scheduler
    while scheduler.has_work:
        for out in llm.step():
            tokens[out.request_id].extend(out.token_ids)
        if chunked:
            for seq in scheduler.prefilling:  # partly fed
                assert llm.engine.cache.lengths[seq.slot] < len(seq.prompt_ids) - 1
            beside |= bool(scheduler.prefilling and scheduler.running)
    assert not llm.engine.feed.prefilling and scheduler.num_running == 0
    return [tokens[r.seq.request_id] for r in requests], beside


@pytest.mark.parametrize("method", ["plain", "draft_model", "ngram", "suffix", "eagle", "ngram_tree", "layer_skip"])
def test_chunked_equals_whole_prompts(model_dirs, tmp_path_factory, llama, method, monkeypatch):
    """On the fast backend the chunks share the decoding step's forward (chains; counted), else they are fed
    apart; both give the outputs of whole prompts."""
    from specdec.models import fast_llama

    fused = []
    split = fast_llama.segments
    monkeypatch.setattr(fast_llama, "segments",
                        lambda batch, starts: (batch.chunk_rows and fused.append(1)) or split(batch, starts))
    config = spec(model_dirs, method, tmp_path_factory, llama)
    greedy = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
    sampled = [SamplingParams(max_tokens=12, temperature=0.9, seed=100 + i, ignore_eos=True)
               for i in range(len(PROMPTS))]
    for params in (greedy, sampled):
        if method == "suffix" and params is sampled:
            # The shared suffix cache holds the requests finished so far, and chunking changes which
            # finished before another drafts: its drafts (so the random numbers verification draws)
            # would differ, the distribution not. Sampled runs compare each request's own drafts.
            config = {**config, "suffix_cache_max_tokens": 0}
        whole, _ = run(model_dirs, config, False, params)
        chunked, beside = run(model_dirs, config, True, params)
        assert beside, "no prompt chunk was fed beside a decoding step"
        assert chunked == whole
        assert all(len(t) == 12 for t in chunked)
    assert bool(fused) == (method not in ("ngram_tree", "layer_skip")), f"{len(fused)} fused forwards"


def test_chunked_on_the_transformers_backend(model_dirs):
    """The transformers backend reads every position it is given: a chunk fed at the wrong ones fails here."""
    config = {"method": "draft_model", "model": str(model_dirs["llama"]["random"]), "num_speculative_tokens": 3}
    greedy = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
    assert run(model_dirs, config, True, greedy, "hf")[0] == run(model_dirs, config, False, greedy, "hf")[0]


def test_chunk_sizes_follow_the_budget(model_dirs):
    """Decoding rows take their tokens first; the prompt gets the rest of the budget (at least the floor)."""
    budget = 40
    llm = LLM(model_dirs["llama"]["target"], dtype="float64", max_num_seqs=4, max_num_batched_tokens=budget)
    short = [llm.submit({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=60, temperature=0.0,
                                                                         ignore_eos=True))
             for _ in range(3)]
    llm.step()
    assert len(llm.scheduler.running) == 3
    long = llm.submit({"prompt_token_ids": list(range(1, 91))}, SamplingParams(max_tokens=2, ignore_eos=True))
    fed = []
    while long.seq not in llm.scheduler.running:
        llm.step()
        fed.append(llm.engine.cache.lengths[long.seq.slot])
    # 89 prompt tokens to cache, 37 per step beside 3 decoding rows: 37, 74, then the last 15.
    assert fed[:2] == [budget - 3, 2 * (budget - 3)] and len(fed) == 3
    assert all(not s.seq.finished for s in short)
    assert budget - 3 >= MIN_PREFILL_CHUNK


@pytest.mark.parametrize("paced", [False, True])
def test_drafts_count_against_a_token_budget_not_a_paced_one(model_dirs, paced):
    """A budget of tokens (given, or on a GPU) holds the decoding rows' drafts too, as in vLLM, so a prompt
    gets what the rows and their drafts leave. A paced budget (a server on a CPU) prices the drafting step's
    time instead: the drafts take nothing from the prompt, which gets what it would beside plain decoding."""
    path = str(model_dirs["llama"]["target"])
    llm = LLM(path, speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 3},
              dtype="float64", max_num_seqs=4, max_num_batched_tokens=60)
    if paced:
        llm.scheduler.pacer = _Fixed(60)  # grants every prompt token the cap allows
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    for i in range(3):
        llm.submit({"prompt_token_ids": [3 + i, 4, 5]}, params)
    for _ in range(2):
        llm.step()
    assert len(llm.scheduler.running) == 3 and llm.scheduler._last_drafted == 9  # the draft is the target
    long = llm.submit({"prompt_token_ids": list(range(1, 91))}, params)
    llm.step()
    assert llm.engine.cache.lengths[long.seq.slot] == (60 - 3 if paced else 60 - 3 - 9)


def test_auto_k_is_told_the_prompt_tokens_fed_beside_the_drafts_and_the_queue(model_dirs):
    """Auto k prices a step's drafts with the prompt tokens it feeds besides, and drafts nothing while a queue waits
    (:mod:`specdec.k_choice`): the policy is asked with the step's chunks and the prompt tokens that wait past the
    next step (what this step leaves, less as many as it feeds), and with none on a step that feeds no prompt; the
    step with a queue drafted nothing. The step whose prompt the next step finishes is told no queue."""
    path = str(model_dirs["llama"]["target"])
    llm = LLM(path, speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": "auto"},
              dtype="float64", max_num_seqs=4, max_num_batched_tokens=40)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    for i in range(3):
        llm.submit({"prompt_token_ids": [3 + i, 4, 5]}, params)
    llm.step()
    calls = spy(llm.engine.policy, "choose")
    llm.step()
    long = llm.submit({"prompt_token_ids": list(range(1, 91))}, params)
    llm.step()
    fed = llm.engine.cache.lengths[long.seq.slot]
    assert 89 - 2 * fed > 0 and [call[3:] for call in calls] == [(0, 0), (fed, 89 - 2 * fed)]
    assert calls[1][3] >= MIN_PREFILL_CHUNK and llm.scheduler._last_drafted == 0
    while 89 - llm.engine.cache.lengths[long.seq.slot] > 2 * fed:  # until the step after next would finish it
        llm.step()
    llm.step()
    left = 89 - llm.engine.cache.lengths[long.seq.slot]
    assert 0 < left <= calls[-1][3] and calls[-1][4] == 0  # tokens left after the step, which the next one feeds


def test_abort_while_prefilling_frees_the_slot(model_dirs):
    llm = LLM(model_dirs["llama"]["target"], speculative_config={"method": "suffix", "num_speculative_tokens": 3},
              dtype="float64", max_num_seqs=2, max_num_batched_tokens=4)
    request = llm.submit({"prompt_token_ids": list(range(1, 60))}, SamplingParams(max_tokens=4))
    llm.step()
    assert llm.scheduler.prefilling == [request.seq] and llm.engine.is_prefilling(request.seq)
    llm.abort(request.seq.request_id)
    assert not llm.scheduler.has_work and not llm.engine.feed.prefilling
    assert sorted(llm.scheduler._free) == [0, 1]
    out = llm.generate({"prompt_token_ids": list(range(1, 60))}, SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("kwargs, message", [
    ({"max_num_batched_tokens": 3}, "smaller than max_num_seqs"),
    ({"max_num_batched_tokens": 0}, "integer >= 1"),
    ({"max_num_batched_tokens": 64, "enable_chunked_prefill": False}, "takes enable_chunked_prefill"),
    ({"enable_chunked_prefill": "yes"}, "True or False"),
])
def test_bad_settings(model_dirs, kwargs, message):
    with pytest.raises(SpecDecError, match=message):
        LLM(model_dirs["llama"]["target"], dtype="float64", max_num_seqs=4, **kwargs)
