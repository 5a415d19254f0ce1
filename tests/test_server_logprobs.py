"""``logprobs`` on ``/v1/completions`` and ``/v1/chat/completions`` (OpenAI's two shapes, streamed and not,
with ``n > 1`` and ``stream_options.include_usage``), ``echo``, and a 400 naming the parameter for every bad
value; a speculative server's values equal the offline plain LLM's (float64 tiny models); echo with logprobs
and ``prompt_logprobs`` give the prompt's."""

from __future__ import annotations

import json

import httpx
import pytest
from test_server import PLAIN, SPEC, TEMPLATE, Served, draft_dir, make_llm  # noqa: F401

from specdec import SamplingParams
from specdec.server import create_app

PROMPT = "for i in range(10):\n    print("
CHAT = [{"role": "user", "content": "def f(x):"}]
TOL = 1e-9


@pytest.fixture(scope="module")
def server(text_model_dirs, draft_dir):  # noqa: F811
    served = Served(create_app(make_llm(text_model_dirs, draft_dir, SPEC), served_model_name="tiny", api_key="",
                               chat_template=TEMPLATE))
    yield served
    served.stop()


@pytest.fixture(scope="module")
def plain(text_model_dirs, draft_dir):  # noqa: F811
    return make_llm(text_model_dirs, draft_dir, PLAIN)


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.root}/v1/{route}", json={"model": "tiny", **body}, timeout=60)


def stream(server, route: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", f"{server.root}/v1/{route}", json={"model": "tiny", "stream": True, **body},
                      timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def check_completion_shape(logprobs: dict, num_top: int) -> None:
    tokens, values, tops, offsets = (logprobs[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"))
    assert len(tokens) == len(values) == len(tops) == len(offsets) > 0
    for token, value, top in zip(tokens, values, tops):
        assert top[token] == value and num_top <= len(top) <= num_top + 1
        best = sorted(top.values(), reverse=True)[:num_top]
        assert value <= 0 and (value in best or len(top) == num_top + 1)
    assert offsets == sorted(offsets) and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], tokens)
                                              if not t.startswith("bytes:"))


def test_completions_logprobs_equal_offline_plain_decoding(server, plain):
    response = post(server, "completions", {"prompt": PROMPT, "temperature": 0, "max_tokens": 20, "logprobs": 3,
                                            "ignore_eos": True})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    check_completion_shape(choice["logprobs"], 3)
    assert choice["logprobs"]["text_offset"][0] == 0
    offline = plain.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, logprobs=3,
                                                    ignore_eos=True))[0].outputs[0]
    expected = [e[t].logprob for e, t in zip(offline.logprobs, offline.token_ids)]
    assert len(choice["logprobs"]["token_logprobs"]) == len(expected)
    assert all(abs(a - b) < TOL for a, b in zip(choice["logprobs"]["token_logprobs"], expected))
    decoded = [e[t].decoded_token for e, t in zip(offline.logprobs, offline.token_ids)]
    for token, text in zip(choice["logprobs"]["tokens"], decoded):  # a partial UTF-8 character is written as bytes
        assert token == text or token.startswith("bytes:\\x") and text == "\ufffd"
    assert any(t.startswith("bytes:") for t in choice["logprobs"]["tokens"])
    assert server.state.llm.batch_metrics.num_accepted_tokens > 0


def test_streamed_n2_completions_carry_each_chunks_logprobs_and_the_usage(server):
    body = {"prompt": PROMPT, "temperature": 0.8, "seed": 5, "max_tokens": 16, "n": 2, "logprobs": 2,
            "ignore_eos": True}
    whole = post(server, "completions", body).json()
    events = stream(server, "completions", {**body, "stream_options": {"include_usage": True}})
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 32
    pieces: dict[int, dict[str, list]] = {0: {}, 1: {}}
    for event in events[:-1]:
        (choice,) = event["choices"]
        if choice["logprobs"] is not None:
            for key, values in choice["logprobs"].items():
                pieces[choice["index"]].setdefault(key, []).extend(values)
    for index in (0, 1):
        assert pieces[index] == whole["choices"][index]["logprobs"]  # text_offset continues across chunks
        check_completion_shape(pieces[index], 2)
    assert pieces[0]["tokens"] != pieces[1]["tokens"]  # two samples (seed, seed + 1)


def check_chat_shape(logprobs: dict, num_top: int) -> None:
    assert logprobs["refusal"] is None and logprobs["content"]
    for item in logprobs["content"]:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        top = [t["logprob"] for t in item["top_logprobs"]]
        assert len(top) == num_top and top == sorted(top, reverse=True)
        assert all(isinstance(b, int) and 0 <= b < 256 for b in item["bytes"])
        assert item["logprob"] <= top[0] if top else True


def test_chat_logprobs_streamed_and_not(server):
    body = {"messages": CHAT, "temperature": 0, "max_tokens": 12, "logprobs": True, "top_logprobs": 4,
            "ignore_eos": True}
    whole = post(server, "chat/completions", body).json()["choices"][0]
    check_chat_shape(whole["logprobs"], 4)
    assert all(item["logprob"] == item["top_logprobs"][0]["logprob"] for item in whole["logprobs"]["content"])
    content = []
    for event in stream(server, "chat/completions", body):
        for choice in event["choices"]:
            if choice["logprobs"] is not None:
                content.extend(choice["logprobs"]["content"])
    assert content == whole["logprobs"]["content"]
    raw = bytes(b for item in content for b in item["bytes"])
    assert raw.decode("utf-8", errors="replace") == server.state.llm.tokenizer.decode(
        server.state.llm.tokenizer(whole["message"]["content"])["input_ids"])
    without = post(server, "chat/completions", {**body, "top_logprobs": None}).json()["choices"][0]["logprobs"]
    assert [item["top_logprobs"] for item in without["content"]] == [[]] * len(without["content"])


def test_the_openai_client_parses_both_shapes(server):
    client = server.client()
    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, logprobs=2, temperature=0)
    assert len(completion.choices[0].logprobs.token_logprobs) == 5
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, logprobs=True, top_logprobs=2,
                                          temperature=0)
    assert [len(c.top_logprobs) for c in chat.choices[0].logprobs.content] == [2] * 5
    plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3)
    assert plain.choices[0].logprobs is None


def test_echo_prepends_the_prompt(server):
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 8}
    text = post(server, "completions", body).json()["choices"][0]["text"]
    echoed = post(server, "completions", {**body, "echo": True}).json()["choices"][0]["text"]
    assert echoed == PROMPT + text
    ids = server.state.llm.tokenizer(PROMPT)["input_ids"]
    assert post(server, "completions", {**body, "prompt": ids, "echo": True}).json()["choices"][0]["text"] == echoed
    streamed = "".join(c["text"] for e in stream(server, "completions", {**body, "echo": True, "n": 2})
                       for c in e["choices"] if c["index"] == 1)
    assert streamed == echoed


def test_echo_with_logprobs_leads_with_the_prompts_logprobs(server, plain):
    """OpenAI's echo with logprobs (what lm-eval-harness scores with): the prompt's tokens lead the logprobs, the
    first with null values, each other one with plain decoding's prompt logprobs, then the output's; vLLM's
    ``prompt_logprobs`` field too; every choice of ``n`` carries its prompt's."""
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 5, "logprobs": 2, "echo": True, "n": 2}
    response = post(server, "completions", body)
    assert response.status_code == 200, response.text
    offline = plain.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, logprobs=2, prompt_logprobs=2))[0]
    ids = offline.prompt_token_ids
    for choice in response.json()["choices"]:
        logprobs = choice["logprobs"]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert len(logprobs["tokens"]) == len(ids) + len(offline.outputs[0].token_ids)
        expected = [e[t].logprob for e, t in zip(offline.prompt_logprobs[1:], ids[1:])] + [
            e[t].logprob for e, t in zip(offline.outputs[0].logprobs, offline.outputs[0].token_ids)]
        assert all(abs(a - b) < TOL for a, b in zip(logprobs["token_logprobs"][1:], expected))
        check_completion_shape({k: v[1:] for k, v in logprobs.items()}, 2)
        assert logprobs["text_offset"][0] == 0 and choice["text"].startswith(PROMPT)
    scored = post(server, "completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 1}).json()
    entries = scored["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for entry, token, reference in zip(entries[1:], ids[1:], offline.prompt_logprobs[1:]):
        assert abs(entry[str(token)]["logprob"] - reference[token].logprob) < TOL and 1 <= len(entry) <= 2



def test_streamed_echo_with_logprobs_leads_each_choice_with_the_prompt(server):
    """A stream with echo and logprobs: each choice's first chunk is the prompt's text with its logprobs (the
    choices after a prompt's first wait for its scores), then the output's chunks; joined, a choice's text and
    logprobs equal the whole response's, and with continuous usage the lead counts no completion token."""
    body = {"prompt": [PROMPT, "def g(y):"], "temperature": 0, "max_tokens": 6, "logprobs": 2, "echo": True, "n": 2}
    whole = post(server, "completions", body)
    assert whole.status_code == 200, whole.text
    events = stream(server, "completions", {**body, "stream_options": {"include_usage": True,
                                                                        "continuous_usage_stats": True}})
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    for choice in whole.json()["choices"]:
        mine = [(e, c) for e in events for c in e["choices"] if c["index"] == choice["index"]]
        lead, rest = mine[0], mine[1:]
        prompt = (PROMPT, "def g(y):")[choice["index"] // 2]
        assert lead[1]["text"] == prompt and lead[0]["usage"]["completion_tokens"] == 0
        assert len(lead[1]["logprobs"]["tokens"]) == len(server.state.llm.tokenizer(prompt)["input_ids"])
        assert "".join(c["text"] for _, c in mine) == choice["text"]
        joined = {k: [v for _, c in mine if c["logprobs"] for v in c["logprobs"][k]] for k in keys}
        assert joined["tokens"] == choice["logprobs"]["tokens"]
        assert joined["text_offset"] == choice["logprobs"]["text_offset"]
        assert joined["token_logprobs"][0] is None
        whole_values = choice["logprobs"]["token_logprobs"]
        assert all(abs(a - b) < TOL for a, b in zip(joined["token_logprobs"][1:], whole_values[1:]))
        assert rest[-1][1]["finish_reason"] == choice["finish_reason"]
    assert events[-1]["usage"]["completion_tokens"] == whole.json()["usage"]["completion_tokens"]

BAD = [
    ("completions", {"logprobs": 21}, "logprobs", "0..20"),
    ("completions", {"logprobs": -1}, "logprobs", "0..20"),
    ("completions", {"logprobs": True}, "logprobs", "integer"),
    ("completions", {"logprobs": "3"}, "logprobs", "integer"),
    ("completions", {"logprobs": 2.5}, "logprobs", "integer"),
    ("completions", {"top_logprobs": 2}, "top_logprobs", "not supported"),
    ("completions", {"echo": 1}, "echo", "boolean"),
    ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "whole response only"),
    ("chat/completions", {"prompt_logprobs": 0, "stream": True}, "prompt_logprobs", "whole response only"),
    ("chat/completions", {"prompt_logprobs": 21}, "prompt_logprobs", "0..20"),
    ("chat/completions", {"logprobs": 1}, "logprobs", "boolean"),
    ("chat/completions", {"top_logprobs": 3}, "top_logprobs", "logprobs is not true"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "0..20"),
    ("chat/completions", {"logprobs": True, "top_logprobs": -2}, "top_logprobs", "0..20"),
    ("chat/completions", {"logprobs": True, "top_logprobs": "2"}, "top_logprobs", "integer"),
    ("chat/completions", {"echo": True}, "echo", "not supported"),
]


@pytest.mark.parametrize("route, extra, param, words", BAD, ids=range(len(BAD)))
def test_bad_logprobs_values_are_a_400_naming_the_parameter(server, route, extra, param, words):
    base = {"prompt": PROMPT} if route == "completions" else {"messages": CHAT}
    response = post(server, route, {**base, "max_tokens": 2, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_a_streamed_choice_waits_behind_its_lead():
    """``events`` with a lead: a choice whose output comes before its prompt's first choice scored the prompt
    holds that output until its lead can be built, then sends the lead and the held outputs in order."""
    import asyncio

    from specdec.outputs import StreamOutput
    from specdec.server.protocol import CompletionRequest
    from specdec.server.respond import Choice, events

    class Outputs:  # the part of a Submission that events reads
        jobs = [0, 1]

        def __init__(self) -> None:
            self.choices = [Choice(), Choice()]

        async def updates(self):
            for index, item in [(1, StreamOutput([7], "a")), (1, StreamOutput([8], "b")),
                                (0, StreamOutput([5], "x", prompt_logprobs=[None])),
                                (1, StreamOutput([9], "c", finished=True, finish_reason="length")),
                                (0, StreamOutput([6], "y", finished=True, finish_reason="length"))]:
                if item.prompt_logprobs is not None:
                    self.choices[index].prompt_logprobs = item.prompt_logprobs
                yield index, item

        def close(self) -> None:
            pass

    outputs = Outputs()

    def lead(index: int):
        return None if outputs.choices[0].prompt_logprobs is None else {"choices": [{"index": index, "text": "P"}]}

    def chunk(index, text, finish, logprobs):
        return {"index": index, "text": text, "finish_reason": finish}

    async def run() -> list[str]:
        fields = CompletionRequest(model="m", prompt="p", stream=True)
        return [e async for e in events(outputs, fields, chunk, [], {}, None, lead)]

    sent = [json.loads(e[6:]) for e in asyncio.run(run()) if e.startswith("data: {")]
    texts = [(c["index"], c["text"]) for e in sent for c in e["choices"]]
    assert texts == [(0, "P"), (1, "P"), (1, "a"), (1, "b"), (0, "x"), (1, "c"), (0, "y")]
