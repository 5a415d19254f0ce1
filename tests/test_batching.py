"""Batching: per-row sampling parameters in one batch, batch invariance of seeded requests, and
continuous batching (joining, leaving, aborting, queueing, slot reuse) through ``llm.scheduler``."""

import pytest
import torch
from helpers import make_sequence
from transformers import AutoModelForCausalLM

from specdec import LLM, SamplingParams
from specdec.sampling import SamplingBatch, logits_to_probs

CPU = torch.device("cpu")
METHODS = ["plain", "draft_model", "ngram"]
PROMPTS = [
    [3, 5, 7, 3, 5, 7, 11, 3, 5],
    [42, 1, 17, 29, 8, 64, 2],
    [7],
    [10, 20, 10, 20, 10],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
    [90, 91, 90, 91],
]


def speculative_config(dirs, method, k=3):
    if method == "plain":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k}
    return {"method": "draft_model", "model": str(dirs["truncated"]), "num_speculative_tokens": k}


def make_llm(model_dirs, method, arch="llama", max_num_seqs=4, backend="auto"):
    dirs = model_dirs[arch]
    return LLM(dirs["target"], speculative_config=speculative_config(dirs, method), dtype="float64",
               max_num_seqs=max_num_seqs, backend=backend)


def alone(llm, prompt, params):
    """Tokens of one request run by itself."""
    return llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def greedy_refs(model_dirs):
    """transformers' greedy continuation (40 tokens) of each prompt, Llama target."""
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"]["target"], dtype=torch.float64)
    refs = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        refs.append(out[0, len(prompt):].tolist())
    return refs


class Runner:
    """Drives ``llm.scheduler`` by hand and collects every request's tokens from the step outputs."""

    def __init__(self, llm):
        self.llm = llm
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.steps: list[list[str]] = []

    def add(self, request_id, prompt, params):
        seq = make_sequence(request_id, prompt, params, seed=params.seed or 0)
        self.tokens[request_id] = []
        self.llm.scheduler.add(seq)
        return seq

    def step(self, n=1):
        for _ in range(n):
            outputs = self.llm.scheduler.step()
            self.steps.append([o.request_id for o in outputs])
            for out in outputs:
                self.tokens[out.request_id].extend(out.token_ids)
                if out.finish_reason:
                    self.finish[out.request_id] = out.finish_reason

    def drain(self):
        while self.llm.scheduler.has_work:
            self.step()


# ---------------------------------------------------------------- per-row sampling parameters

def test_sampling_batch_rows_follow_their_own_parameters():
    """``SamplingBatch.probs`` of a mixed batch equals ``logits_to_probs`` of each row alone."""
    torch.manual_seed(0)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=0.9, top_k=12, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.0),
    ]
    logits = torch.randn(len(params), 3, 32, dtype=torch.float64) * 3
    batch = SamplingBatch(params, [None] * len(params), CPU)
    probs = batch.probs(logits)
    for row, p in enumerate(params):
        torch.testing.assert_close(probs[row], logits_to_probs(logits[row], p), rtol=0, atol=1e-15)
        assert torch.allclose(probs[row].sum(-1), torch.ones(3, dtype=torch.float64))
    assert (probs[0] == torch.nn.functional.one_hot(logits[0].argmax(-1), 32)).all()
    assert ((probs[1] > 0).sum(-1) == 5).all()
    assert ((probs[5] > 0).sum(-1) == 32).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_sampling_batch_row_probs_are_bit_identical_in_any_batch(dtype):
    """A row's distribution does not change in its last bits with its neighbours' parameters
    (float32 arithmetic is where a batch-wide renormalisation would show)."""
    torch.manual_seed(1)
    logits = (torch.randn(2, 3, 500) * 3).to(dtype)
    mine = [SamplingParams(temperature=0.9), SamplingParams(temperature=0.9, top_k=50),
            SamplingParams(temperature=0.9, top_p=0.95), SamplingParams(temperature=1.2, min_p=0.01)]
    others = [SamplingParams(top_k=5, top_p=0.9), SamplingParams(top_p=0.5), SamplingParams(top_k=3),
              SamplingParams(min_p=0.1), SamplingParams(temperature=0)]
    for p in mine:
        single = SamplingBatch([p], [None], CPU).probs(logits[:1])[0]
        for other in others:
            pair = SamplingBatch([other, p], [None, None], CPU).probs(logits.flip(0))[1]
            assert torch.equal(pair, single), f"{p} changed next to {other}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parameters_past_the_work_dtypes_range_still_give_a_distribution(dtype):
    """A temperature above float32's largest number flattens the distribution over the tokens a constraint allows
    (it turned their masked ``-inf`` logits into NaN), and a ``top_p`` below its smallest keeps the most likely token
    (it cut every token, and end-of-text came out)."""
    torch.manual_seed(2)
    logits = (torch.randn(2, 1, 40) * 3).to(dtype)
    logits[:, :, 10:] = -torch.inf  # what a grammar's mask leaves
    hot, flat = SamplingBatch([SamplingParams(temperature=0.5, top_p=1e-300),
                               SamplingParams(temperature=1e300)], [None, None], CPU).probs(logits)
    assert torch.equal(hot[0], torch.nn.functional.one_hot(logits[0, 0].float().argmax(), 40).float())
    assert torch.allclose(flat[0, :10], torch.full((10,), 0.1)) and (flat[0, 10:] == 0).all()
    tiny = SamplingBatch([SamplingParams(temperature=0.5, top_p=1e-40)], [None], CPU).probs(logits[:1])
    assert torch.equal(tiny, hot[None])


def test_sampling_batch_random_numbers_come_from_each_rows_generator():
    """A row's uniforms and noise are the same whatever the other rows are."""
    def gen(seed):
        return torch.Generator().manual_seed(seed)

    sampled, greedy = SamplingParams(temperature=1.0), SamplingParams(temperature=0)
    probs = torch.full((3, 16), 1 / 16, dtype=torch.float64)
    batch = SamplingBatch([sampled, greedy, sampled], [gen(1), gen(2), gen(3)], CPU)
    uniforms = batch.uniforms([2, 3, 1], 3, CPU, torch.float64)
    noise = batch.noise(probs)
    single = SamplingBatch([sampled], [gen(3)], CPU)
    torch.testing.assert_close(uniforms[2, :1], single.uniforms([1], 1, CPU, torch.float64)[0], rtol=0, atol=0)
    torch.testing.assert_close(noise[2], single.noise(probs[:1])[0], rtol=0, atol=0)
    assert uniforms[1].tolist() == [0, 0, 0] and (noise[1] == 1).all()  # greedy rows draw nothing
    assert uniforms[0, 2] == 0 and uniforms[2, 1:].tolist() == [0, 0]  # padding past a row's drafts


@pytest.mark.parametrize("method", METHODS)
def test_mixed_batch_rows_keep_their_own_parameters(model_dirs, greedy_refs, method):
    """Greedy rows and rows whose parameters leave one candidate (top_k=1, a tiny top_p, min_p=1)
    give exactly the greedy tokens while unrestricted sampled rows in the same batch do not; every
    seeded row gives the tokens it gives alone."""
    llm = make_llm(model_dirs, method, max_num_seqs=8)
    prompt = PROMPTS[0]
    params = [
        SamplingParams(temperature=0, max_tokens=30),
        SamplingParams(temperature=1.5, top_k=1, max_tokens=30, seed=1),
        SamplingParams(temperature=2.0, top_p=1e-9, max_tokens=30, seed=2),
        SamplingParams(temperature=1.0, min_p=1.0, max_tokens=30, seed=3),
        SamplingParams(temperature=1.0, max_tokens=30, seed=4),
        SamplingParams(temperature=1.5, top_k=40, top_p=0.95, max_tokens=30, seed=5),
        SamplingParams(temperature=0.8, min_p=0.05, max_tokens=30, seed=6),
    ]
    outputs = llm.generate([{"prompt_token_ids": prompt}] * len(params), params)
    tokens = [o.outputs[0].token_ids for o in outputs]
    for row in range(4):
        assert tokens[row] == greedy_refs[0][:30], f"row {row} ({params[row]}) left the greedy path"
    for row in range(4, 7):
        assert tokens[row] != greedy_refs[0][:30], f"row {row} sampled the greedy path: parameters ignored?"
        assert tokens[row] == alone(llm, prompt, params[row])
    assert len(set(map(tuple, tokens[4:]))) == 3


# ---------------------------------------------------------------- batch invariance

SUBJECTS = [
    (PROMPTS[0], SamplingParams(temperature=0.9, top_k=20, max_tokens=30, seed=11)),
    (PROMPTS[1], SamplingParams(temperature=1.2, top_p=0.9, max_tokens=26, seed=12)),
    (PROMPTS[2], SamplingParams(temperature=0.7, min_p=0.05, max_tokens=22, seed=13)),
    (PROMPTS[3], SamplingParams(temperature=0, max_tokens=25)),
]


@pytest.mark.parametrize("arch,method", [("llama", m) for m in METHODS] + [("gpt2", "draft_model"),
                                                                          ("qwen2", "ngram")])
def test_seeded_requests_are_batch_invariant(model_dirs, arch, method):
    """Each subject gives the tokens it gives alone, while other requests join (some queued
    behind a full pool), finish early or are aborted around it."""
    llm = make_llm(model_dirs, method, arch=arch, max_num_seqs=4)
    expected = [alone(llm, prompt, params) for prompt, params in SUBJECTS]
    assert all(len(e) == p.max_tokens for e, (_, p) in zip(expected, SUBJECTS))

    run = Runner(llm)
    filler = lambda i, n: SamplingParams(temperature=1.1, max_tokens=n, seed=100 + i)  # noqa: E731
    run.add("s0", *SUBJECTS[0])
    run.step(2)
    run.add("f0", PROMPTS[4], filler(0, 4))  # joins, leaves after a few steps
    run.add("f1", PROMPTS[5], filler(1, 40))  # joins, aborted below
    run.step(2)
    run.add("s1", *SUBJECTS[1])
    run.add("f2", PROMPTS[2], filler(2, 3))
    run.add("s2", *SUBJECTS[2])  # queued: the pool (4 slots) is full
    run.step(2)
    assert "f1" in run.steps[-1]
    llm.scheduler.abort("f1")
    run.add("f3", PROMPTS[0], filler(3, 6))
    run.step(3)
    run.add("s3", *SUBJECTS[3])
    run.add("f4", PROMPTS[3], filler(4, 50))
    run.drain()

    for i, want in enumerate(expected):
        assert run.tokens[f"s{i}"] == want, f"subject {i} changed inside a batch"
        assert run.finish[f"s{i}"] == "length"
    batch_sizes = [len(ids) for ids in run.steps]
    assert max(batch_sizes) == 4 and min(batch_sizes) == 1, "the batch must grow and shrink"
    assert "f1" not in run.finish and len(run.tokens["f1"]) < 40
    assert llm.engine.cache.lengths == [0, 0, 0, 0]


# ---------------------------------------------------------------- continuous batching

@pytest.mark.parametrize("method", METHODS)
def test_requests_join_while_others_run(model_dirs, greedy_refs, method):
    llm = make_llm(model_dirs, method, max_num_seqs=4)
    run = Runner(llm)
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n)  # noqa: E731
    run.add("a", PROMPTS[0], greedy(30))
    run.step(3)
    assert run.steps == [["a"]] * 3
    run.add("b", PROMPTS[1], greedy(20))
    run.add("c", PROMPTS[2], greedy(10))
    run.step()
    if llm.engine.target.fuses_prefill:  # their prompts were fed in that step's forward: they emit from the next
        assert run.steps[-1] == ["a"] and llm.scheduler.num_running == 3
        run.step()
    assert run.steps[-1] == ["a", "b", "c"], "new requests join at the next step, not after the running one"
    assert 0 < len(run.tokens["a"]) < 30
    run.drain()
    assert run.tokens == {"a": greedy_refs[0][:30], "b": greedy_refs[1][:20], "c": greedy_refs[2][:10]}


@pytest.mark.parametrize("method", METHODS)
def test_abort_frees_the_slot_and_reuse_carries_nothing_stale(model_dirs, method):
    """A long request is aborted mid-way; a queued request takes its slot at the next step and
    gives exactly what it gives in a fresh LLM (target pool and drafter state both clean)."""
    llm = make_llm(model_dirs, method, max_num_seqs=2)
    fresh = make_llm(model_dirs, method, max_num_seqs=2)
    long_prompt = PROMPTS[4] * 3
    victim_params = SamplingParams(temperature=0.8, max_tokens=60, seed=5)
    late_params = SamplingParams(temperature=0.9, max_tokens=25, seed=6)
    run = Runner(llm)
    victim = run.add("victim", long_prompt, victim_params)
    other = run.add("other", PROMPTS[1], SamplingParams(temperature=0, max_tokens=40))
    late = run.add("late", PROMPTS[3], late_params)
    run.step(4)
    assert [s.request_id for s in llm.scheduler.waiting] == ["late"]
    victim_slot = victim.slot
    assert llm.engine.cache.lengths[victim_slot] > len(long_prompt)

    assert llm.scheduler.abort("victim") is True
    assert victim.slot == -1 and llm.engine.cache.lengths[victim_slot] == 0
    assert [s.request_id for s in llm.scheduler.running] == ["other"]
    drafter = llm.engine.drafter
    if method == "draft_model":
        assert drafter.cache.lengths[victim_slot] == 0
    elif method == "ngram":
        assert set(drafter._indexes) == {"other", "late"} or set(drafter._indexes) == {"other"}
        assert "victim" not in drafter._indexes

    run.step()
    assert late.slot == victim_slot and not llm.scheduler.waiting
    run.drain()
    assert run.tokens["late"] == alone(fresh, PROMPTS[3], late_params)
    assert run.tokens["other"] == alone(fresh, PROMPTS[1], other.params)
    assert "victim" not in run.finish
    assert llm.engine.cache.lengths == [0, 0]
    if method == "ngram":
        assert drafter._indexes == {}
    assert llm.scheduler.abort("victim") is False  # already gone: a no-op


def test_abort_a_waiting_request(model_dirs):
    llm = make_llm(model_dirs, "draft_model", max_num_seqs=1)
    run = Runner(llm)
    run.add("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=5))
    run.add("b", PROMPTS[1], SamplingParams(temperature=0, max_tokens=5))
    run.step()
    assert llm.scheduler.abort("b") is True
    run.drain()
    assert run.tokens["b"] == [] and all(ids == ["a"] for ids in run.steps)


@pytest.mark.parametrize("method", METHODS)
def test_more_requests_than_slots_all_complete(model_dirs, greedy_refs, method):
    """Six requests through one slot and through four: all complete, in order of arrival, each
    equal to its own greedy reference."""
    for slots in (1, 4):
        llm = make_llm(model_dirs, method, max_num_seqs=slots)
        params = [SamplingParams(temperature=0, max_tokens=8 + 3 * i) for i in range(len(PROMPTS))]
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        for i, output in enumerate(outputs):
            assert output.outputs[0].token_ids == greedy_refs[i][: 8 + 3 * i]
            assert output.finished and output.outputs[0].finish_reason == "length"
        assert llm.batch_metrics.mean_batch_size <= slots
        assert not llm.scheduler.has_work and llm.engine.cache.lengths == [0] * slots


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_batch_metrics_aggregate_the_requests(model_dirs, method):
    """BatchMetrics counts every row of every step: its totals equal the sums of the requests'."""
    llm = make_llm(model_dirs, method, max_num_seqs=3)
    params = [SamplingParams(temperature=0.8 if i % 2 else 0, max_tokens=6 + 4 * i, seed=i) for i in range(5)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:5]], params)
    metrics = [o.metrics for o in outputs]
    batch = llm.batch_metrics
    assert batch.num_generated_tokens == sum(m.num_generated_tokens for m in metrics) == sum(p.max_tokens
                                                                                              for p in params)
    assert batch.num_rows == sum(m.num_steps for m in metrics)
    assert batch.num_draft_tokens == sum(m.num_draft_tokens for m in metrics) > 0
    assert batch.num_accepted_tokens == sum(m.num_accepted_tokens for m in metrics)
    assert 1 < batch.mean_batch_size <= 3
    assert batch.num_steps < batch.num_rows
    assert batch.tokens_per_step == batch.num_generated_tokens / batch.num_steps
    assert min(batch.time_prefill, batch.time_drafting, batch.time_target, batch.time_other) > 0
    for m in metrics:
        assert m.num_prompt_tokens > 0 and m.time_target > 0 and m.time_prefill > 0
        assert sum(m.drafted_per_position) == m.num_draft_tokens
        assert sum(m.accepted_per_position) == m.num_accepted_tokens


def test_acceptance_counts_only_the_drafts_the_output_kept(text_model_dirs):
    """With a draft identical to the target every draft is accepted. An output that ends inside a step's accepted
    drafts (a stop token, a stop string) counts as accepted only the drafts it kept, and as generated only its
    tokens, in the request's metrics, the engine's and the step outputs the server counts (it counted them all)."""
    spec = {"method": "draft_model", "model": str(text_model_dirs["draft"]), "num_speculative_tokens": 4}
    llm = LLM(text_model_dirs["target"], dtype="float64", speculative_config=spec)
    prompt = "def f(x):"
    tokens = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0].token_ids
    cut = next(i for i in (2, 3, 1) if tokens[i] not in tokens[:i])  # a stop token inside the first step's drafts
    text = llm.tokenizer.decode(tokens[: cut + 1])
    ends = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[tokens[cut]]),
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[text[-2:]])]
    for params in ends:
        before = (llm.batch_metrics.num_generated_tokens, llm.batch_metrics.num_accepted_tokens)
        handle = llm.submit(prompt, params)
        stepped = []
        while not handle.done:
            stepped += llm.step()
        out = list(handle.pending)
        kept = [t for o in out for t in o.token_ids]
        metrics = out[-1].metrics
        assert kept == tokens[: len(kept)] and len(kept) <= cut + 1 and out[-1].finish_reason == "stop"
        assert metrics.num_steps == 1 and metrics.num_generated_tokens == len(kept)
        assert metrics.num_accepted_tokens == len(kept) == sum(metrics.accepted_per_position)  # no bonus token
        assert sum(o.num_accepted for o in stepped) == metrics.num_accepted_tokens
        assert sum(len(o.token_ids) for o in stepped) == len(kept)
        assert (llm.batch_metrics.num_generated_tokens - before[0], llm.batch_metrics.num_accepted_tokens - before[1]
                ) == (len(kept), metrics.num_accepted_tokens)
