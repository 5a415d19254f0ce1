"""``specdec serve`` end to end: a real uvicorn server on a free loopback port, the official
``openai`` client, tiny float64 models (greedy output is then exact)."""

from __future__ import annotations

import json
import platform
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import uvicorn
from helpers import truncated_copy
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec import LLM, SamplingParams, SpecDecError
from specdec.server import create_app

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant> {% endif %}")
KEY = "sekret-key"
PROMPTS = ["def f(x):\n", "for i in range(10):\n    print(", "x = 1\n"]
SPEC = "spec"
PLAIN = "plain"


@pytest.fixture(scope="module")
def draft_dir(text_model_dirs, tmp_path_factory):
    """A draft that disagrees with the text target sometimes (its first layer only)."""
    model = AutoModelForCausalLM.from_pretrained(text_model_dirs["target"], dtype=torch.float64)
    path = tmp_path_factory.mktemp("server_draft")
    truncated_copy(model, keep_layers=1).save_pretrained(path)
    AutoTokenizer.from_pretrained(text_model_dirs["target"]).save_pretrained(path)
    return path


def make_llm(text_model_dirs, draft_dir, kind: str, max_num_seqs: int = 4) -> LLM:
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3} if kind == SPEC else None
    return LLM(text_model_dirs["target"], speculative_config=spec, dtype="float64", max_num_seqs=max_num_seqs)


class Served:
    """A uvicorn server in a thread on a free loopback port."""

    def __init__(self, app) -> None:
        self.app = app
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.root = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    @property
    def state(self):
        return self.app.state.specdec

    def client(self, api_key: str = "unused", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.root + "/v1", api_key=api_key, max_retries=0, **kwargs)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = httpx.get(self.root + "/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def value(self, name: str, **labels) -> float:
        return sum(v for (n, lab), v in self.metrics().items()
                   if n == name and all(dict(lab).get(k) == w for k, w in labels.items()))

    def settle(self) -> None:
        deadline = time.monotonic() + 10
        while self.value("vllm:num_requests_running") or self.value("vllm:num_requests_waiting"):
            assert time.monotonic() < deadline, "requests are still running"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def spec_server(text_model_dirs, draft_dir):
    """draft_model speculation, a chat template given, no auth."""
    served = Served(create_app(make_llm(text_model_dirs, draft_dir, SPEC), served_model_name="tiny", api_key="",
                               chat_template=TEMPLATE))
    yield served
    served.stop()


@pytest.fixture(scope="module")
def plain_server(text_model_dirs, draft_dir):
    """Plain decoding, auth on, no chat template, a small queue and body limit."""
    served = Served(create_app(make_llm(text_model_dirs, draft_dir, PLAIN, max_num_seqs=2), served_model_name="tiny",
                               api_key=KEY, max_queue_len=1, max_body_bytes=20_000))
    yield served
    served.stop()


@pytest.fixture(scope="module")
def offline(text_model_dirs, draft_dir):
    return {kind: make_llm(text_model_dirs, draft_dir, kind) for kind in (SPEC, PLAIN)}


def offline_texts(llm: LLM, prompts, params) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("kind", [SPEC, PLAIN])
def test_greedy_completions_equal_offline_generate(kind, spec_server, plain_server, offline):
    served = spec_server if kind == SPEC else plain_server
    client = served.client(KEY)
    params = SamplingParams(temperature=0, max_tokens=40, stop=["\n\n"])
    expected = offline_texts(offline[kind], PROMPTS, params)
    response = client.completions.create(model="tiny", prompt=PROMPTS, temperature=0, max_tokens=40, stop=["\n\n"])
    assert [c.text for c in sorted(response.choices, key=lambda c: c.index)] == expected
    assert offline_texts(offline[PLAIN], PROMPTS, params) == expected  # speculation is lossless
    ids = offline[kind].tokenizer(PROMPTS[0])["input_ids"]
    by_ids = client.completions.create(model="tiny", prompt=ids, temperature=0, max_tokens=40, stop=["\n\n"])
    assert by_ids.choices[0].text == expected[0]
    usage = response.usage
    assert usage.prompt_tokens == sum(len(offline[kind].tokenizer(p)["input_ids"]) for p in PROMPTS)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens > usage.prompt_tokens
    extension = usage.model_extra["specdec"]
    assert (extension["num_drafts"] > 0) == (kind == SPEC)
    assert extension["mean_acceptance_length"] >= 1.0


def test_streamed_chunks_concatenate_to_the_text(spec_server):
    client = spec_server.client()
    for prompt in PROMPTS:
        kwargs = dict(model="tiny", prompt=prompt, max_tokens=50, temperature=0.8, seed=3, stop=["):"])
        whole = client.completions.create(**kwargs)
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_chat_uses_the_template(spec_server, offline):
    client = spec_server.client()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x):"}]
    tokenizer = offline[SPEC].tokenizer
    prompt = tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    expected = offline[SPEC].generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=30))
    response = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=30)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected[0].outputs[0].text
    assert response.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=30,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected[0].outputs[0].text
    assert chunks[-1].choices[0].finish_reason == expected[0].outputs[0].finish_reason


def test_chat_without_a_template_is_a_clear_400(plain_server):
    with pytest.raises(openai.BadRequestError) as info:
        plain_server.client(KEY).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert "--chat-template" in info.value.body["message"]


def test_sixteen_concurrent_mixed_requests(spec_server, offline):
    client = spec_server.client()
    cases = []
    for i in range(16):
        prompt = PROMPTS[i % 3] + "#" * (i % 4)
        kind = i % 4
        if kind == 0:
            kwargs = dict(temperature=0, max_tokens=20 + i)
        elif kind == 1:
            kwargs = dict(temperature=0.9, top_k=20, seed=i, max_tokens=25)
        elif kind == 2:
            kwargs = dict(temperature=1.1, top_p=0.8, min_p=0.05, seed=i, max_tokens=30, stop=[")"])
        else:
            kwargs = dict(temperature=0.7, seed=i, max_tokens=15, n=2)
        cases.append((prompt, kwargs, i % 2 == 1))
    batches_before = spec_server.value("specdec:step_batch_size_count")
    small_before = spec_server.value("specdec:step_batch_size_bucket", le="2.0")

    def run(case):
        prompt, kwargs, stream = case
        extra = {k: kwargs[k] for k in ("top_k", "min_p") if k in kwargs}  # vLLM's extensions
        kwargs = {k: v for k, v in kwargs.items() if k not in extra} | {"extra_body": extra}
        if not stream:
            return [c.text for c in client.completions.create(model="tiny", prompt=prompt, **kwargs).choices]
        texts = ["", ""]
        for chunk in client.completions.create(model="tiny", prompt=prompt, stream=True, **kwargs):
            texts[chunk.choices[0].index] += chunk.choices[0].text
        return texts[: kwargs.get("n", 1)]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, cases))
    for (prompt, kwargs, _), texts in zip(cases, results):
        n = kwargs.pop("n", 1)
        seed = kwargs.pop("seed", None)
        params = [SamplingParams(**kwargs, seed=None if seed is None else seed + c) for c in range(n)]
        assert texts == offline_texts(offline[SPEC], [prompt] * n, params), (prompt, kwargs)
    steps = spec_server.value("specdec:step_batch_size_count") - batches_before
    small = spec_server.value("specdec:step_batch_size_bucket", le="2.0") - small_before
    assert steps > 0 and small < steps  # steps of more than two sequences ran: the batched path
    spec_server.settle()


def error_of(call, status: int) -> dict:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    assert info.value.status_code == status
    body = info.value.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in body["error"]["message"]
    return body["error"]


def test_bad_requests_get_400_in_openai_shape(spec_server):
    client = spec_server.client()
    create = client.completions.create
    error = error_of(lambda: create(model="tiny", prompt="x", extra_body={"colour": "red"}), 400)
    assert "colour" in error["message"]
    error = error_of(lambda: create(model="tiny", prompt="x", max_tokens="many"), 400)
    assert error["param"] == "max_tokens"
    error = error_of(lambda: create(model="tiny", prompt="x", top_p=1.5), 400)
    assert "top_p" in error["message"]
    error = error_of(lambda: create(model="tiny", prompt="x", temperature=-1), 400)
    assert "temperature" in error["message"]
    error = error_of(lambda: create(model="tiny", prompt="x " * 400), 400)
    # the model by its served name: a client is not shown the server's folders
    assert "too long: the context window of 'tiny' is" in error["message"] and "/" not in error["message"]
    error = error_of(lambda: create(model="tiny", prompt="x", logprobs=21), 400)
    assert "logprobs" in error["message"] and error["param"] == "logprobs"
    error = error_of(lambda: create(model="tiny", prompt=[10**6]), 400)
    assert "vocabulary" in error["message"]
    response = httpx.post(spec_server.root + "/v1/completions", content=b"{not json")
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    for media, status in (("text/plain", 415), ("application/x-www-form-urlencoded", 415),
                          ("application/json; charset=utf-8", 200), (None, 200)):
        headers = {} if media is None else {"content-type": media}
        response = httpx.post(spec_server.root + "/v1/completions", content=body, headers=headers)
        assert response.status_code == status, (media, response.text)
        if status == 415:
            assert "unsupported media type" in response.json()["error"]["message"]


def test_unknown_model_route_queue_full_and_body_limit(spec_server, plain_server, monkeypatch):
    error = error_of(lambda: spec_server.client().completions.create(model="other", prompt="x"), 404)
    assert (error["code"], error["type"]) == ("model_not_found", "invalid_request_error")  # OpenAI's
    response = httpx.get(spec_server.root + "/v2/nothing")
    assert response.status_code == 404 and set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert response.json()["error"]["type"] == "invalid_request_error"
    client = plain_server.client(KEY)
    # 2 slots + 1 queued: 4 sequences can never run, whatever the load (400, not 429 "retry later").
    error = error_of(lambda: client.completions.create(model="tiny", prompt="x", n=4), 400)
    assert "at most 3" in error["message"] and error["param"] == "n"
    llm = plain_server.state.llm
    step = llm.step

    def slow_step():
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(llm, "step", slow_step)
    with httpx.stream("POST", plain_server.root + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "x", "n": 3, "max_tokens": 150, "ignore_eos": True, "stream": True}) as busy:
        lines = busy.iter_lines()
        first = next(lines)
        assert first.startswith("data: ") and busy.status_code == 200, first
        error = error_of(lambda: client.completions.create(model="tiny", prompt="x"), 429)  # full right now
        assert "queue is full" in error["message"]
        full = httpx.post(plain_server.root + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"prompt": "x"})
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
    monkeypatch.setattr(llm, "step", step)
    plain_server.settle()
    error = error_of(lambda: client.completions.create(model="tiny", prompt="x" * 30_000), 413)
    assert "larger than" in error["message"]
    assert client.completions.create(model="tiny", prompt="x", n=3, max_tokens=3).usage.completion_tokens > 0


def test_auth(plain_server, spec_server):
    error = error_of(lambda: plain_server.client("wrong").models.list(), 401)
    assert (error["code"], error["type"]) == ("invalid_api_key", "invalid_request_error")
    assert httpx.get(plain_server.root + "/v1/models").status_code == 401
    assert [m.id for m in plain_server.client(KEY).models.list().data] == ["tiny"]
    assert [m.id for m in spec_server.client("anything").models.list().data] == ["tiny"]  # auth off
    assert httpx.get(plain_server.root + "/health").json() == {"status": "ok"}  # no key needed


def test_disconnect_aborts_and_frees_the_slot(spec_server, monkeypatch):
    spec_server.settle()
    llm = spec_server.state.llm
    step = llm.step

    def slow_step():  # a tiny model finishes 180 tokens too fast for a client to leave in between
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(llm, "step", slow_step)
    aborted = spec_server.value("specdec:request_aborted_total")
    finished = {reason: spec_server.value("vllm:request_success_total", finished_reason=reason)
                for reason in ("stop", "length", "abort")}
    series = {dict(labels).get("finished_reason") for name, labels in spec_server.metrics()
              if name == "vllm:request_success_total"}
    assert series == {"stop", "length", "abort"}  # every reason's series exists from the start, as vLLM's
    with httpx.stream("POST", spec_server.root + "/v1/completions",
                      json={"prompt": "x = 1\n", "max_tokens": 180, "ignore_eos": True, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert spec_server.value("vllm:num_requests_running") == 1
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming request whose client gives up
        httpx.post(spec_server.root + "/v1/completions", timeout=0.5,
                   json={"prompt": "x = 1\n", "max_tokens": 180, "ignore_eos": True})
    spec_server.settle()
    assert spec_server.value("specdec:request_aborted_total") == aborted + 2
    assert {reason: spec_server.value("vllm:request_success_total", finished_reason=reason)
            for reason in ("stop", "length", "abort")} == {**finished, "abort": finished["abort"] + 2}
    monkeypatch.setattr(llm, "step", step)
    # Every slot is free again: max_num_seqs sequences run in one step.
    four_before = spec_server.value("specdec:step_batch_size_count") - spec_server.value(
        "specdec:step_batch_size_bucket", le="2.0")
    response = spec_server.client().completions.create(model="tiny", prompt="x", n=4, max_tokens=20,
                                                       temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.finish_reason for c in response.choices] == ["length"] * 4
    four_after = spec_server.value("specdec:step_batch_size_count") - spec_server.value(
        "specdec:step_batch_size_bucket", le="2.0")
    assert four_after > four_before


def test_metrics_add_up_to_the_requests_own(spec_server):
    spec_server.settle()
    names = ["vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
             "vllm:spec_decode_num_accepted_tokens_total"]
    before = {n: spec_server.value(n) for n in names}
    per_pos_before = [spec_server.value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
                      for i in range(3)]
    tokens_before = spec_server.value("vllm:generation_tokens_total")
    client = spec_server.client()
    usages = [client.completions.create(model="tiny", prompt=p, max_tokens=30, temperature=t, seed=1).usage
              for p in PROMPTS for t in (0, 1.0)]
    metrics = spec_server.metrics()
    assert {n for n, _ in metrics} >= {"vllm:num_requests_running", "vllm:num_requests_waiting",
                                       "vllm:time_to_first_token_seconds_bucket",
                                       "vllm:inter_token_latency_seconds_bucket",
                                       "vllm:e2e_request_latency_seconds_bucket", "process_resident_memory_bytes"}
    keys = ["num_drafts", "num_draft_tokens", "num_accepted_tokens"]
    for name, key in zip(names, keys):
        assert spec_server.value(name) - before[name] == sum(u.model_extra["specdec"][key] for u in usages) > 0
    for i in range(3):
        delta = spec_server.value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
        expected = sum((u.model_extra["specdec"]["accepted_per_position"] + [0] * 3)[i] for u in usages)
        assert delta - per_pos_before[i] == expected
    assert spec_server.value("vllm:generation_tokens_total") - tokens_before == sum(u.completion_tokens
                                                                                    for u in usages)


def test_a_failing_engine_step_is_a_logged_500_without_a_traceback(text_model_dirs, draft_dir, caplog):
    """An unexpected error inside a step: the client gets a 500 in OpenAI's shape (no traceback,
    no internals), the server log has the cause, and the server goes on serving."""
    llm = make_llm(text_model_dirs, draft_dir, PLAIN)
    served = Served(create_app(llm, served_model_name="tiny", api_key=""))
    step = llm.engine.step
    calls = []

    def failing(seqs, **kwargs):
        if not calls:
            calls.append(1)
            raise RuntimeError("injected failure in the engine step")
        return step(seqs, **kwargs)

    llm.engine.step = failing
    try:
        with caplog.at_level("ERROR", logger="specdec.server"):
            response = httpx.post(served.root + "/v1/completions", timeout=30,
                                  json={"model": "tiny", "prompt": "x = 1\n", "max_tokens": 4})
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["type"] == "server_error" and "server log" in error["message"]
        assert "Traceback" not in response.text and "injected" not in response.text
        assert any("engine step failed" in r.getMessage() and r.exc_info and "injected" in str(r.exc_info[1])
                   for r in caplog.records)
        after = served.client().completions.create(model="tiny", prompt="x = 1\n", max_tokens=4, temperature=0)
        assert after.choices[0].finish_reason == "length"
        served.settle()
    finally:
        served.stop()


def test_the_worker_returns_the_free_heap_when_it_falls_idle(spec_server, monkeypatch):
    """After a burst the worker hands the heap's free pages back (glibc's malloc_trim), so that an idle server's
    resident memory does not stay at the burst's peak; at most every TRIM_EVERY seconds."""
    from specdec.server import worker

    assert worker.return_free_heap() is (platform.libc_ver()[0] == "glibc")
    spec_server.settle()
    calls = []
    monkeypatch.setattr(worker, "TRIM_EVERY", 0.0)
    monkeypatch.setattr(worker, "return_free_heap", lambda: calls.append(1) or True)
    spec_server.client().completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls, "the worker fell idle without returning the free heap"
    monkeypatch.setattr(worker, "TRIM_EVERY", 3600.0)  # a trim within the hour: no other
    calls.clear()
    spec_server.client().completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, temperature=0)
    time.sleep(0.2)
    assert not calls


def test_min_tokens_holds_the_stop_token_back(spec_server, offline):
    """vLLM's ``min_tokens`` through the ``openai`` client's ``extra_body``: the first greedy token, made a stop
    token, ends the output at once without it and not before the third token with ``min_tokens=3``."""
    client = spec_server.client(KEY)
    first = offline[PLAIN].generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids
    body = {"stop_token_ids": first}
    plain = client.completions.create(model="tiny", prompt=PROMPTS[0], temperature=0, max_tokens=6, extra_body=body)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens == 1
    held = client.completions.create(model="tiny", prompt=PROMPTS[0], temperature=0, max_tokens=6,
                                     extra_body={**body, "min_tokens": 3})
    expected = offline[PLAIN].generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=first,
                                                                  min_tokens=3))[0].outputs[0]
    assert held.usage.completion_tokens == len(expected.token_ids) >= 3
    assert held.choices[0].text == expected.text


def test_penalties_and_logit_bias_are_applied_as_offline(spec_server, offline):
    """OpenAI's ``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` (token ids as string keys), and
    vLLM's ``repetition_penalty``, ``allowed_token_ids`` and ``bad_words`` (``extra_body``), on the speculative
    server: the greedy
    output of offline plain decoding with the same parameters, and not the unadjusted one."""
    client = spec_server.client(KEY)
    plain = offline[PLAIN].generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    favourite = plain[0].outputs[0].token_ids[0]
    cases = [({"presence_penalty": 1.5, "frequency_penalty": 0.5}, {}),
             ({"logit_bias": {str(favourite): -100, "7": 4.5}}, {}),
             ({}, {"repetition_penalty": 1.6, "allowed_token_ids": list(range(40, 90))}),
             ({}, {"bad_words": [next(text for t in plain[0].outputs[0].token_ids
                                      if (text := offline[PLAIN].tokenizer.decode([t]).strip()).isalnum())]})]
    for openai_fields, extra in cases:
        served = client.completions.create(model="tiny", prompt=PROMPTS[0], temperature=0, max_tokens=12,
                                           extra_body={"ignore_eos": True, **extra}, **openai_fields)
        bias = {int(k): v for k, v in openai_fields.pop("logit_bias", {}).items()} or None
        expected = offline[PLAIN].generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                                      logit_bias=bias, **openai_fields, **extra))
        assert served.choices[0].text == expected[0].outputs[0].text != plain[0].outputs[0].text


def test_llm_chat_equals_the_servers_chat(spec_server, offline):
    """vLLM's ``LLM.chat`` renders a conversation as the server's chat endpoint does: the same greedy answer;
    a list of conversations gives one output each, and bad messages or a missing template are SpecDecErrors."""
    conversation = [{"role": "system", "content": "be brief"},
                    {"role": "user", "content": [{"type": "text", "text": "def f(x):"}]}]
    served = spec_server.client(KEY).chat.completions.create(model="tiny", messages=conversation, temperature=0,
                                                             max_tokens=12)
    llm = offline[SPEC]
    params = SamplingParams(temperature=0, max_tokens=12)
    out = llm.chat(conversation, params, chat_template=TEMPLATE)[0]
    assert out.outputs[0].text == served.choices[0].message.content
    assert out.prompt == "<system> be brief\n<user> def f(x):\n<assistant> "
    assert out.prompt_token_ids == llm.get_tokenizer()(out.prompt, add_special_tokens=False)["input_ids"]
    both = llm.chat([conversation, [{"role": "user", "content": "x = 1"}]], params, chat_template=TEMPLATE)
    assert [o.outputs[0].text for o in both][0] == out.outputs[0].text and len(both) == 2
    as_strings = llm.chat(conversation, params, chat_template=TEMPLATE, chat_template_content_format="string",
                          mm_processor_kwargs=None)[0]  # vLLM's arguments, at the values that mean what is done here
    assert as_strings.prompt == out.prompt and as_strings.outputs[0].text == out.outputs[0].text
    with pytest.raises(SpecDecError, match="chat_template_content_format is not supported by specdec: only 'auto' "
                                           "or 'string'"):
        llm.chat(conversation, params, chat_template=TEMPLATE, chat_template_content_format="openai")
    with pytest.raises(SpecDecError, match=r"messages\[1\] must be a dict with a 'role'"):
        llm.chat([conversation[0], {"role": "robot", "content": "x"}], chat_template=TEMPLATE)
    with pytest.raises(SpecDecError, match="has no chat template: pass chat_template"):
        llm.chat(conversation)
    with pytest.raises(SpecDecError, match="the chat template could not render these messages: nope"):
        llm.chat(conversation, chat_template="{{ raise_exception('nope') }}")


def test_chat_continues_a_final_message_and_takes_template_variables(spec_server, offline):
    """vLLM's ``continue_final_message`` (the assistant's last message left open) and ``chat_template_kwargs``
    (more template variables), in ``LLM.chat`` and the server's chat endpoint alike; their misuses are errors."""
    llm, client = offline[SPEC], spec_server.client(KEY)
    started = [{"role": "user", "content": "def f(x):"}, {"role": "assistant", "content": "return"}]
    params = SamplingParams(temperature=0, max_tokens=6)
    out = llm.chat(started, params, chat_template=TEMPLATE, add_generation_prompt=False,
                   continue_final_message=True)[0]
    assert out.prompt == "<user> def f(x):\n<assistant> return"
    served = client.chat.completions.create(model="tiny", messages=started, temperature=0, max_tokens=6, extra_body={
        "add_generation_prompt": False, "continue_final_message": True})
    assert served.choices[0].message.content == out.outputs[0].text
    greeting = TEMPLATE + "{% if greet %}hello {% endif %}"
    asked = [{"role": "user", "content": "x"}]
    greeted = llm.chat(asked, params, chat_template=greeting, chat_template_kwargs={"greet": True})[0]
    assert greeted.prompt == "<user> x\n<assistant> hello "
    assert llm.chat(asked, params, chat_template=greeting)[0].prompt == "<user> x\n<assistant> "
    for kwargs, words in [({"continue_final_message": True}, "set add_generation_prompt to false"),
                          ({"chat_template_kwargs": {"tokenize": True}}, "cannot set 'tokenize'"),
                          ({"chat_template_kwargs": ["greet"]}, "chat_template_kwargs must be an object"),
                          ({"tools": [{"type": "function"}]}, r"tools\[0\] must be")]:
        with pytest.raises(SpecDecError, match=words):
            llm.chat(started, params, chat_template=TEMPLATE, **kwargs)
    with pytest.raises(SpecDecError, match="which is the user's: it must be the assistant's"):
        llm.chat(asked, params, chat_template=TEMPLATE, add_generation_prompt=False, continue_final_message=True)
    error = error_of(lambda: client.chat.completions.create(model="tiny", messages=started, extra_body={
        "continue_final_message": True}), 400)
    assert error["param"] == "continue_final_message" and "add_generation_prompt" in error["message"]
    error = error_of(lambda: client.chat.completions.create(model="tiny", messages=started, extra_body={
        "chat_template_kwargs": {"add_generation_prompt": False}}), 400)
    assert error["param"] == "chat_template_kwargs"


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_puts_the_running_usage_on_every_chunk(spec_server, chat):
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk carries the choice's usage so far (a chat's role
    chunk the prompt's and no completion token); the last one's equals the final usage chunk's."""
    client = spec_server.client(KEY)
    options = {"include_usage": True, "continuous_usage_stats": True}
    if chat:
        chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                     temperature=0, max_tokens=8, stream=True,
                                                     extra_body={"stream_options": options}))
    else:
        chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], temperature=0, max_tokens=8,
                                                stream=True, extra_body={"stream_options": options}))
    *running, final = chunks
    assert not final.choices and final.usage.completion_tokens >= 1
    assert all(c.usage is not None and c.usage.prompt_tokens == final.usage.prompt_tokens for c in running)
    counts = [c.usage.completion_tokens for c in running]
    assert counts == sorted(counts) and counts[-1] == final.usage.completion_tokens
    if chat:
        assert running[0].choices[0].delta.role == "assistant" and counts[0] == 0


def test_stop_reason_names_what_ended_the_output(spec_server, offline):
    """vLLM's ``stop_reason``: the stop string or ``stop_token_ids`` token that ended an output (None for the
    budget), in the API's outputs and in the server's choices, streamed or not."""
    llm = offline[PLAIN]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    first = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids
    by_token = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6,
                                                       stop_token_ids=first))[0].outputs[0]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", first[0])
    text = llm.generate(PROMPTS[0], greedy)[0].outputs[0].text
    stop = text[3:5]
    by_string = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, stop=["zzzz", stop]))[0]
    assert (by_string.outputs[0].finish_reason, by_string.outputs[0].stop_reason) == ("stop", stop)
    budget = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0].outputs[0]
    assert (budget.finish_reason, budget.stop_reason) == ("length", None)
    client = spec_server.client(KEY)
    served = client.completions.create(model="tiny", prompt=PROMPTS[0], temperature=0, max_tokens=12,
                                       stop=["zzzz", stop])
    assert served.choices[0].stop_reason == stop and served.choices[0].text == by_string.outputs[0].text
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], temperature=0, max_tokens=6,
                                            extra_body={"stop_token_ids": first}, stream=True))
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    assert (last.choices[0].finish_reason, last.choices[0].stop_reason) == ("stop", first[0])
    for include in (False, True):  # the stop token's text only with include_stop_str_in_output, as in vLLM v1
        params = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=first, include_stop_str_in_output=include)
        expected = llm.generate(PROMPTS[0], params)[0].outputs[0].text
        served = client.completions.create(model="tiny", prompt=PROMPTS[0], temperature=0, max_tokens=6,
                                           extra_body={"stop_token_ids": first, "include_stop_str_in_output": include})
        assert served.choices[0].text == expected == llm.tokenizer.decode(first if include else [])


def test_usage_says_how_many_prompt_tokens_the_prefix_cache_held(plain_server):
    """OpenAI's ``usage.prompt_tokens_details.cached_tokens``: the second time a prompt is sent, its whole blocks
    come from the prefix cache; each prompt of a batch counts once, whatever ``n``."""
    prompt = "def cached(x):\n    return x + 1\n" * 2
    headers = {"Authorization": f"Bearer {KEY}"}

    def cached(**body):
        response = httpx.post(plain_server.root + "/v1/completions", headers=headers,
                              json={"prompt": prompt, "max_tokens": 2, "temperature": 0, **body})
        assert response.status_code == 200, response.text
        details = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        return details, response.json()["usage"]["prompt_tokens"]

    cached()
    again, tokens = cached()
    assert again == (tokens - 1) // 16 * 16 > 0  # whole blocks, the last token always computed (its logits)
    assert cached(n=2) == (again, tokens)  # the prompt counted once, as in prompt_tokens
    both, twice = cached(prompt=[prompt, prompt + "#"])
    assert twice > tokens and both >= 2 * again
