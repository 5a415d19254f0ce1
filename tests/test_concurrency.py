"""One ``LLM``, several consumers: interleaved streams, abandoned streams and threads each get
exactly their own tokens (the scheduler owns the model state; one lock guards it)."""

import threading

import pytest
import torch
from helpers import truncated_copy
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec import LLM, SamplingParams, SpecDecError

METHODS = ["plain", "ngram", "draft_model"]
TEXT_PROMPTS = ["def f(x):\n", "for i in range(10):\n    print(", "x = 1\n"]


@pytest.fixture(scope="module")
def text_draft_dir(text_model_dirs, tmp_path_factory):
    """A draft that disagrees with the text target sometimes: its first layer only, with the tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(text_model_dirs["target"], dtype=torch.float64)
    path = tmp_path_factory.mktemp("text_draft")
    truncated_copy(model, keep_layers=1).save_pretrained(path)
    AutoTokenizer.from_pretrained(text_model_dirs["target"]).save_pretrained(path)
    return path


def make_llm(text_model_dirs, text_draft_dir, method, max_num_seqs=4):
    spec = None
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 3}
    elif method == "draft_model":
        spec = {"method": "draft_model", "model": str(text_draft_dir), "num_speculative_tokens": 3}
    return LLM(text_model_dirs["target"], speculative_config=spec, dtype="float64", max_num_seqs=max_num_seqs)


PARAMS = [
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=0.9, top_k=30, max_tokens=24, seed=7, ignore_eos=True),
    SamplingParams(temperature=1.1, top_p=0.9, max_tokens=28, seed=8, ignore_eos=True),
]


def separate_runs(text_model_dirs, text_draft_dir, method):
    """(text, token ids) of each prompt run by itself on a fresh LLM."""
    llm = make_llm(text_model_dirs, text_draft_dir, method)
    out = []
    for prompt, params in zip(TEXT_PROMPTS, PARAMS):
        result = llm.generate(prompt, params)[0].outputs[0]
        out.append((result.text, result.token_ids))
    return out


@pytest.mark.parametrize("method", METHODS)
def test_interleaved_streams_match_separate_runs(text_model_dirs, text_draft_dir, method):
    expected = separate_runs(text_model_dirs, text_draft_dir, method)
    assert len({tokens for _, tokens in map(lambda e: (e[0], tuple(e[1])), expected)}) == 3
    llm = make_llm(text_model_dirs, text_draft_dir, method)
    streams = [llm.stream(p, params) for p, params in zip(TEXT_PROMPTS[:2], PARAMS[:2])]
    pieces = [[], [], []]
    # Alternate one piece at a time; the third stream starts once the first two are under way.
    for _ in range(2):
        for i, stream in enumerate(streams):
            pieces[i].append(next(stream))
    streams.append(llm.stream(TEXT_PROMPTS[2], PARAMS[2]))
    live = {0, 1, 2}
    while live:
        for i in sorted(live):
            try:
                pieces[i].append(next(streams[i]))
            except StopIteration:
                live.discard(i)
    for i, (text, tokens) in enumerate(expected):
        assert [t for piece in pieces[i] for t in piece.token_ids] == tokens, f"stream {i} got other tokens"
        assert "".join(piece.text for piece in pieces[i]) == text
        assert pieces[i][-1].finished and pieces[i][-1].finish_reason == "length"
        assert not any(piece.finished for piece in pieces[i][:-1])
    assert llm.engine.cache.lengths == [0] * 4 and not llm.scheduler.has_work


@pytest.mark.parametrize("method", METHODS)
def test_closed_stream_frees_its_slot(text_model_dirs, text_draft_dir, method):
    expected = separate_runs(text_model_dirs, text_draft_dir, method)
    llm = make_llm(text_model_dirs, text_draft_dir, method, max_num_seqs=1)
    stream = llm.stream(TEXT_PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    next(stream)
    next(stream)
    assert len(llm.scheduler.running) == 1 and llm.engine.cache.lengths[0] > 0
    stream.close()
    assert not llm.scheduler.has_work and llm._inflight.requests == {}
    assert llm.engine.cache.lengths == [0]
    drafter = llm.engine.drafter
    if method == "draft_model":
        assert drafter.cache.lengths == [0]
    elif method == "ngram":
        assert drafter._indexes == {}
    # The single slot is free again and carries nothing stale.
    out = llm.generate(TEXT_PROMPTS[1], PARAMS[1])[0].outputs[0]
    assert (out.text, out.token_ids) == expected[1]


def test_abandoned_stream_does_not_block_others(text_model_dirs, text_draft_dir):
    """A stream that is never consumed again only holds its slot until it is closed; another
    consumer's requests run meanwhile and are unaffected."""
    expected = separate_runs(text_model_dirs, text_draft_dir, "draft_model")
    llm = make_llm(text_model_dirs, text_draft_dir, "draft_model", max_num_seqs=2)
    idle = llm.stream(TEXT_PROMPTS[0], PARAMS[0])
    next(idle)
    outputs = llm.generate(TEXT_PROMPTS[1:], PARAMS[1:])  # one slot left: the two run one after the other
    assert [(o.outputs[0].text, o.outputs[0].token_ids) for o in outputs] == expected[1:]
    rest = list(idle)
    assert rest[-1].finished  # its steps ran along the others' and were kept for it
    idle.close()
    assert not llm.scheduler.has_work


@pytest.mark.parametrize("method", METHODS)
def test_threads_calling_generate_get_their_own_tokens(model_dirs, method):
    dirs = model_dirs["llama"]
    spec = None
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 4}
    elif method == "draft_model":
        spec = {"method": "draft_model", "model": str(dirs["truncated"]), "num_speculative_tokens": 4}
    llm = LLM(dirs["target"], speculative_config=spec, dtype="float64", max_num_seqs=3)
    jobs = []
    for t in range(4):
        prompts = [{"prompt_token_ids": [t + 1, 5, 7, t + 1, 5] * (t + 1)}, {"prompt_token_ids": [40 + t, 2 * t + 1]}]
        params = [SamplingParams(temperature=0, max_tokens=20 + 3 * t),
                  SamplingParams(temperature=0.8, max_tokens=18, seed=50 + t)]
        jobs.append((prompts, params))
    sequential = [[o.outputs[0].token_ids for o in llm.generate(p, s)] for p, s in jobs]

    results: list = [None] * 4
    errors: list = []
    barrier = threading.Barrier(4)

    def worker(i):
        try:
            barrier.wait()
            results[i] = [o.outputs[0].token_ids for o in llm.generate(*jobs[i])]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    steps_before = llm.batch_metrics.num_steps
    rows_before = llm.batch_metrics.num_rows
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert results == sequential
    steps = llm.batch_metrics.num_steps - steps_before
    rows = llm.batch_metrics.num_rows - rows_before
    assert rows / steps > 1.5, "the threads' requests should share batches"
    assert not llm.scheduler.has_work and llm.engine.cache.lengths == [0, 0, 0]


def test_a_failed_step_fails_every_request_and_frees_the_pool(text_model_dirs, text_draft_dir, monkeypatch):
    """An error inside a step reaches every consumer whose request was in flight, frees every slot,
    and the LLM keeps working afterwards."""
    expected = separate_runs(text_model_dirs, text_draft_dir, "draft_model")
    llm = make_llm(text_model_dirs, text_draft_dir, "draft_model", max_num_seqs=3)
    streams = [llm.stream(p, params) for p, params in zip(TEXT_PROMPTS, PARAMS)]
    for stream in streams:
        next(stream)  # a stream submits its request when first iterated
    target = llm.engine.target
    real_forward = target.forward

    def broken(*args, **kwargs):
        raise RuntimeError("device fell over")

    monkeypatch.setattr(target, "forward", broken)
    for stream in streams:
        with pytest.raises(RuntimeError, match="device fell over"):
            for _ in range(10):  # outputs filed before the failure come first
                next(stream)
    monkeypatch.setattr(target, "forward", real_forward)
    assert not llm.scheduler.has_work and llm._inflight.requests == {}
    assert llm.engine.cache.lengths == [0] * 3 and llm.engine.drafter.cache.lengths == [0] * 3
    outputs = llm.generate(TEXT_PROMPTS, PARAMS)
    assert [(o.outputs[0].text, o.outputs[0].token_ids) for o in outputs] == expected


def test_llm_abort_ends_a_running_stream(text_model_dirs, text_draft_dir):
    """``LLM.abort`` of a streaming request frees its slot at once; its stream then ends with a
    clear error, and the other stream is unaffected."""
    expected = separate_runs(text_model_dirs, text_draft_dir, "ngram")
    llm = make_llm(text_model_dirs, text_draft_dir, "ngram", max_num_seqs=2)
    doomed = llm.stream(TEXT_PROMPTS[0], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    next(doomed)
    (request_id,) = [s.request_id for s in llm.scheduler.running]
    kept = llm.stream(TEXT_PROMPTS[1], PARAMS[1])
    first = next(kept)
    llm.abort(request_id)
    assert [s.request_id for s in llm.scheduler.running] != [] and request_id not in {
        s.request_id for s in llm.scheduler.running}
    assert request_id not in llm.engine.drafter._indexes
    with pytest.raises(SpecDecError, match=f"request {request_id} was aborted"):
        for _ in range(200):
            next(doomed)
    rest = list(kept)
    assert [t for piece in [first, *rest] for t in piece.token_ids] == expected[1][1]
    assert not llm.scheduler.has_work and llm.engine.cache.lengths == [0, 0]
