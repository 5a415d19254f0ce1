"""Structure-aware fuzzing of what agents send: valid chat requests with tools, tool choices, reasoning,
constraints, logprobs and streaming, each with a few fields replaced by odd values, against a reasoning model
served with speculation, Hermes' tool-call parser and ``--enable-auto-tool-choice``. Every answer is a 200 or a 4xx
in OpenAI's shape, a stream ends with ``[DONE]`` and any error in it is a client's, and nothing logs a traceback.
The same for the Responses API's and Anthropic's Messages API's requests (items, flat tools, content blocks,
thinking, their formats), whose streams are typed events and whose errors are in their own shapes.

(:mod:`test_server_fuzz` sends arbitrary bodies, which rarely get past the first check; these reach the tool,
reasoning and constraint code behind it.)"""

from __future__ import annotations

import copy
import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_server import Served
from test_server_fuzz import ERROR_KEYS, SURROGATE

from specdec import LLM
from specdec.server import create_app

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant> {% endif %}")
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "now", "description": "the time"}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "200"))


@pytest.fixture(scope="module")
def served(think_model_dirs):
    llm = LLM(think_model_dirs["target"], dtype="float64", max_num_seqs=2, reasoning_parser="deepseek_r1",
              speculative_config={"method": "draft_model", "model": str(think_model_dirs["draft"]),
                                  "num_speculative_tokens": 3})
    server = Served(create_app(llm, served_model_name="tiny", api_key="", chat_template=TEMPLATE,
                               enable_auto_tool_choice=True, tool_call_parser="hermes"))
    yield server
    server.stop()


ODD = st.one_of(st.none(), st.booleans(), st.integers(-3, 5), st.sampled_from(
    [SURROGATE, "", "x" * 200, 10**30, -1e308, [], {}, [None], {"type": None}, {"name": 3}, "auto", "required",
     "none", {"type": "function"}, {"type": "function", "function": {"name": "missing"}}, "<think>", "</think>",
     '{"name": "get_weather"}', {"city": "Oslo"}, [{"type": "text", "text": "hi"}]]))
CHOICE = st.sampled_from([None, "none", "auto", "required", {"type": "function", "function": {"name": "get_weather"}},
                          {"type": "function", "function": {"name": "now"}}])
MESSAGES = st.sampled_from([
    [{"role": "user", "content": "weather?"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"}],
    [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>hm</think>hello"},
     {"role": "user", "content": "again"}],
])
SCHEMAS = st.sampled_from([  # tool parameters a grammar may refuse or find hard
    {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}, {"type": "array"}, {"enum": []}, {"type": "string"},
    {"type": "object", "required": ["x"], "additionalProperties": False}, {"type": "string", "pattern": "("},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 10**9}}, "required": ["s"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["n"]},
    {"type": "object", "properties": {"x": {"type": "nonsense"}}}, {"not": {}}, {"type": "object", "x-odd": SURROGATE},
    {"anyOf": [{"type": "object"}, {"type": "null"}]}, {"type": ["object", "array"]}, {"$defs": 3},
])
CONSTRAINT = st.sampled_from([
    {}, {"response_format": {"type": "json_object"}}, {"guided_regex": "[ab]{1,3}"}, {"guided_choice": ["yes", "no"]},
    {"structured_outputs": {"disable_any_whitespace": True}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}}}])


def mutate(draw, body: dict) -> dict:
    """``body`` (copied) with up to three of its fields, or their parts, replaced by odd values."""
    body = copy.deepcopy(body)  # the constants it shares are not to be mutated
    for _ in range(draw(st.integers(0, 3))):
        path = draw(st.sampled_from(sorted(body)))
        target = body
        if isinstance(body[path], list) and body[path] and draw(st.booleans()):  # a part of a list field
            target, path = body[path], draw(st.integers(0, len(body[path]) - 1))
            if isinstance(target[path], dict) and draw(st.booleans()):
                target, path = target[path], draw(st.sampled_from(sorted(target[path]) or ["role"]))
        target[path] = copy.deepcopy(draw(ODD))  # a fresh value: the constants are shared across examples
    return body


def options(draw, body: dict, choices: list[tuple[str, st.SearchStrategy]]) -> dict:
    for key, values in choices:
        if draw(st.booleans()):
            body[key] = draw(values)
    return body


def start(draw, conversation: str, turns: st.SearchStrategy, limit: str) -> dict:
    """A request's core: its ``conversation`` field drawn from ``turns``, a short ``limit`` (its API's name of
    max_tokens), greedy or sampled, seeded."""
    return {"model": "tiny", conversation: draw(turns), limit: draw(st.integers(1, 6)),
            "temperature": draw(st.sampled_from([0, 0.8])), "seed": draw(st.integers(0, 5))}


def offer_tools(draw, body: dict, tools: list[dict], choices: st.SearchStrategy) -> bool:
    """Half the time: ``tools``, and a tool choice drawn from ``choices`` (None: none sent); whether it did."""
    if not draw(st.booleans()):
        return False
    body["tools"] = tools
    if (choice := draw(choices)) is not None:
        body["tool_choice"] = choice
    return True


@st.composite
def bodies(draw) -> dict:
    """A valid-looking chat request, then up to three of its fields (or their parts) replaced by odd values."""
    body = start(draw, "messages", MESSAGES, "max_tokens")
    if offer_tools(draw, body, TOOLS, CHOICE):
        if draw(st.booleans()):
            body["parallel_tool_calls"] = draw(st.booleans())
        if draw(st.integers(0, 3)) == 0:
            body["tools"] = [TOOLS[0], {"type": "function", "function": {"name": "odd", "parameters": draw(SCHEMAS)}}]
            body["tool_choice"] = draw(st.sampled_from(["required", {"type": "function", "function": {"name": "odd"}},
                                                        "auto"]))
    body.update(draw(CONSTRAINT))
    options(draw, body, [("stream", st.booleans()), ("n", st.integers(1, 2)), ("logprobs", st.booleans()),
                         ("top_logprobs", st.integers(0, 2)), ("skip_special_tokens", st.booleans()),
                         ("stop", st.sampled_from(["a", ["</think>"], "}"])),
                         ("chat_template_kwargs", st.sampled_from([{"enable_thinking": False}, {}])),
                         ("thinking_token_budget", st.integers(0, 4)),
                         ("stream_options", st.sampled_from([{"include_usage": True},
                                                             {"continuous_usage_stats": True}]))])
    if body.get("top_logprobs"):
        body["logprobs"] = True
    return mutate(draw, body)


FLAT = [{"type": "function", "name": "get_weather", "parameters": CITY}, {"type": "function", "name": "now"}]
ITEMS = st.sampled_from([
    "weather?",
    [{"role": "developer", "content": "be brief"}, {"role": "user", "content": [{"type": "input_text",
                                                                                 "text": "weather?"}]}],
    [{"role": "user", "content": "weather?"},
     {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "ask"}]},
     {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
     {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
])


LAST = "<the last stored response>"
"""A ``previous_response_id`` the fuzz test replaces by the id of the last response it got (stored or not)."""


@st.composite
def responses_bodies(draw) -> dict:
    """A valid-looking Responses API request, then up to three of its fields replaced by odd values."""
    body = start(draw, "input", ITEMS, "max_output_tokens")
    offer_tools(draw, body, FLAT, st.sampled_from([None, "none", "auto", "required",
                                                   {"type": "function", "name": "now"},
                                                   {"type": "function", "name": "get_weather"}]))
    options(draw, body, [("stream", st.booleans()), ("parallel_tool_calls", st.booleans()),
                         ("instructions", st.sampled_from(["be brief", "<think>"])),
                         ("text", st.sampled_from([{"format": {"type": "json_object"}},
                                                   {"format": {"type": "json_schema", "name": "c", "schema": CITY}},
                                                   {"format": {"type": "text"}}])),
                         ("structured_outputs", st.sampled_from([{"disable_any_whitespace": True},
                                                                 {"regex": "[ab]{1,3}"}])),
                         ("stop", st.sampled_from(["a", ["</think>"], "}"])),
                         ("reasoning", st.sampled_from([{"effort": "low"}, {}])),
                         ("previous_response_id", st.just(LAST)), ("store", st.booleans()),
                         ("chat_template_kwargs", st.sampled_from([{"enable_thinking": False}, {}]))])
    return mutate(draw, body)


A_TOOLS = [{"name": "get_weather", "input_schema": CITY}, {"name": "now", "input_schema": {"type": "object"},
                                                            "description": "the time"}]
TURNS = st.sampled_from([
    [{"role": "user", "content": "weather?"}],
    [{"role": "user", "content": [{"type": "text", "text": "weather?"}]},
     {"role": "assistant", "content": [{"type": "thinking", "thinking": "ask", "signature": ""},
                                       {"type": "tool_use", "id": "t1", "name": "get_weather",
                                        "input": {"city": "Oslo"}}]},
     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "x"}],
])


@st.composite
def messages_bodies(draw) -> dict:
    """A valid-looking Anthropic Messages request, then up to three of its fields replaced by odd values."""
    body = start(draw, "messages", TURNS, "max_tokens")
    offer_tools(draw, body, A_TOOLS, st.sampled_from([
        None, {"type": "none"}, {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "now"},
        {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}]))
    options(draw, body, [("stream", st.booleans()), ("system", st.sampled_from(["be brief",
                                                                                [{"type": "text", "text": "s"}]])),
                         ("thinking", st.sampled_from([{"type": "enabled", "budget_tokens": 2}, {"type": "disabled"},
                                                       {"type": "adaptive"}])),
                         ("output_config", st.sampled_from([{"format": {"type": "json_schema", "schema": CITY}},
                                                            {"effort": "low"}])),
                         ("structured_outputs", st.sampled_from([{"disable_any_whitespace": True},
                                                                 {"regex": "[ab]{1,3}"}])),
                         ("stop_sequences", st.sampled_from([["a"], ["</think>"], ["}"]])),
                         ("top_k", st.integers(0, 3))])
    return mutate(draw, body)


def check_error(error: dict) -> None:
    assert set(error) == ERROR_KEYS and "Traceback" not in error["message"], error


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(body=bodies())
def test_agent_requests_get_an_answer_or_a_clear_4xx(served, body, caplog):
    raw = json.dumps(body)  # ensure_ascii: a lone surrogate travels as its \\u escape
    with caplog.at_level("ERROR"), httpx.stream("POST", f"{served.root}/v1/chat/completions", content=raw,
                                                 headers={"content-type": "application/json"}, timeout=60) as got:
        text = got.read().decode()
    event(f"status {got.status_code}")
    assert got.status_code in (200, 400, 404, 413, 429), (got.status_code, text[:300], raw[:300])
    if got.status_code != 200:
        check_error(json.loads(text)["error"])
    elif body.get("stream") is True:
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", text[-300:]
        for chunk in map(json.loads, events[:-1]):
            if "error" in chunk:  # an error found after the stream began: a client's, in OpenAI's shape
                check_error(chunk["error"])
                assert chunk["error"]["code"] < 500, (chunk, raw[:300])
            else:
                assert all(c["delta"].get("tool_calls") is None or all(
                    "index" in t for t in c["delta"]["tool_calls"]) for c in chunk["choices"]), chunk
    else:
        for choice in json.loads(text)["choices"]:
            # calls carry JSON arguments unless max_tokens or a stop string cut them (a stop string ends a
            # constrained output wherever it matches, as in vLLM: docs/structured-output.md, Limits)
            whole = choice["finish_reason"] != "length" and not isinstance(choice["stop_reason"], str)
            for call in choice["message"].get("tool_calls") or () if whole else ():
                json.loads(call["function"]["arguments"])
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


def typed_stream(text: str) -> list[dict]:
    """The events of a typed stream (``event:`` and ``data:`` lines)."""
    lines = [line for line in text.splitlines() if line]
    events = [json.loads(line[6:]) for line in lines[1::2]]
    assert [line[7:] for line in lines[::2]] == [e["type"] for e in events], text[-300:]
    return events


def check_response(body: dict, status: int, text: str) -> None:
    """A Responses API answer: an error in OpenAI's shape; a stream that ends with the whole response (or a
    client's error); calls whose arguments are JSON where the response completed."""
    if status != 200:
        return check_error(json.loads(text)["error"])
    if body.get("stream") is True:
        events = typed_stream(text)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        if events[-1]["type"] == "error":  # a client's
            assert events[-1]["code"] != "server_error", events[-1]
            return
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
        response = events[-1]["response"]
    else:
        response = json.loads(text)
    stopped = isinstance(body.get("stop"), str | list)  # a stop string may cut a call (docs: Limits)
    for item in response["output"] if response["status"] == "completed" and not stopped else ():
        if item["type"] == "function_call":
            json.loads(item["arguments"])


def check_message(body: dict, status: int, text: str) -> None:
    """A Messages API answer: an error in Anthropic's shape; a stream of Anthropic's events that ends with
    message_stop (or an error event)."""
    if status != 200:
        error = json.loads(text)
        assert error["type"] == "error" and set(error["error"]) == {"type", "message"}, error
        return
    if body.get("stream") is True:
        events = typed_stream(text)
        assert events[0]["type"] == "message_start", events[0]
        assert events[-1]["type"] in ("message_stop", "error"), events[-1]
        if events[-1]["type"] == "error":
            assert events[-1]["error"]["type"] != "api_error", events[-1]
    else:
        message = json.loads(text)
        assert message["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use"), message
        assert (message["stop_reason"] == "tool_use") == any(b["type"] == "tool_use" for b in message["content"]) or \
            message["stop_reason"] == "max_tokens", message


@pytest.mark.parametrize("route, check, strategy", [("responses", check_response, responses_bodies()),
                                                    ("messages", check_message, messages_bodies())],
                         ids=["responses", "messages"])
def test_agent_requests_of_the_other_apis_get_an_answer_or_a_clear_4xx(served, route, check, strategy, caplog):
    last = ["resp_none"]  # the id of the last response answered

    @settings(max_examples=EXAMPLES // 2, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=strategy)
    def run(body):
        if body.get("previous_response_id") == LAST:
            body["previous_response_id"] = last[0]
        raw = json.dumps(body)
        with httpx.stream("POST", f"{served.root}/v1/{route}", content=raw,
                          headers={"content-type": "application/json"}, timeout=60) as got:
            text = got.read().decode()
        event(f"status {got.status_code}" + (" (a continuation)" if "previous_response_id" in body else ""))
        assert got.status_code in (200, 400, 404, 413, 429), (got.status_code, text[:300], raw[:300])
        check(body, got.status_code, text)
        if route == "responses" and got.status_code == 200:
            answer = typed_stream(text)[-1].get("response") if body.get("stream") is True else json.loads(text)
            last[0] = answer["id"] if answer else last[0]

    with caplog.at_level("ERROR"):
        run()
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
