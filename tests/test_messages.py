"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``): a message holds what the chat
endpoint answers to the same request (text, tool calls, thinking, usage, stop reason), read by Anthropic's client;
its event stream, read by the client's stream helper, builds the same message; tool_use and tool_result blocks
render as the chat messages they stand for; errors are in Anthropic's shape and name the Messages field."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from test_reasoning import post as chat
from test_responses import typed_events
from test_server import TEMPLATE, Served, draft_dir  # noqa: F401
from test_tools import COMPACT, HERMES, TOOLS, hermes_app

from specdec import LLM
from specdec.server import create_app

TOOLS_A = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"],
            **({"description": t["function"]["description"]} if "description" in t["function"] else {})}
           for t in TOOLS]  # Anthropic's tools


@pytest.fixture(scope="module")
def server(text_model_dirs, draft_dir):  # noqa: F811
    served = Served(hermes_app(text_model_dirs, draft_dir))
    yield served
    served.stop()


def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.root, api_key="unused", max_retries=0)


def post(server, body: dict, route: str = "messages") -> httpx.Response:
    return httpx.post(f"{server.root}/v1/{route}", json={"model": "tiny", **body}, timeout=60)


def events(server, body: dict) -> list[dict]:
    return typed_events(server, "messages", body)


def streamed_blocks(events: list[dict]) -> list[dict]:
    """The content blocks assembled from the deltas alone, as a client without the helpers does; every block is
    started, then stopped, in order."""
    blocks, open_ = [], None
    for event in events:
        if event["type"] == "content_block_start":
            assert open_ is None and event["index"] == len(blocks)
            block = event["content_block"]
            assert block.get("text", "") == block.get("thinking", "") == "" and block.get("input", {}) == {}
            blocks.append({"type": block["type"], "name": block.get("name"), "text": ""})
            open_ = event["index"]
        elif event["type"] == "content_block_delta":
            assert event["index"] == open_
            delta = event["delta"]
            blocks[open_]["text"] += delta.get("text") or delta.get("thinking") or delta.get("partial_json") or ""
        elif event["type"] == "content_block_stop":
            assert event["index"] == open_
            open_ = None
    assert open_ is None
    return blocks


def whole_blocks(message: dict) -> list[dict]:
    return [{"type": b["type"], "name": b.get("name"),
             "text": json.dumps(b["input"], separators=(",", ":")) if b["type"] == "tool_use" else
             b.get("text") or b.get("thinking")} for b in message["content"]]


def compact(blocks: list[dict]) -> list[dict]:
    """Streamed blocks with their calls' arguments in the compact form of :func:`whole_blocks`."""
    return [{**b, "text": json.dumps(json.loads(b["text"]), separators=(",", ":"))} if b["type"] == "tool_use"
            else b for b in blocks]


def test_a_message_holds_the_chat_answer(server):
    """Text through Anthropic's client: the answer and usage equal the chat endpoint's for the same messages; stop
    reasons max_tokens and stop_sequence (with the sequence that matched)."""
    message = client(server).messages.create(model="tiny", system="be brief", max_tokens=8,
                                             messages=[{"role": "user", "content": "weather?"}],
                                             extra_body={"ignore_eos": True, "temperature": 0})
    expected = chat(server, {"messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "weather?"}],
                             "temperature": 0, "max_completion_tokens": 8, "ignore_eos": True})
    assert message.content[0].type == "text" and len(message.content) == 1
    assert message.content[0].text == expected["choices"][0]["message"]["content"]
    assert (message.stop_reason, message.stop_sequence, message.role) == ("max_tokens", None, "assistant")
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == expected["usage"]["prompt_tokens"]
    assert usage.output_tokens == 8 and message.id.startswith("msg_") and message.model == "tiny"
    stop = message.content[0].text[-2:]
    stopped = client(server).messages.create(model="tiny", system="be brief", max_tokens=30, stop_sequences=[stop],
                                             messages=[{"role": "user", "content": "weather?"}],
                                             extra_body={"temperature": 0})
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    count = client(server).messages.count_tokens(model="tiny", system="be brief",
                                                 messages=[{"role": "user", "content": "weather?"}])
    assert count.input_tokens == expected["usage"]["prompt_tokens"]


def test_the_stream_builds_the_same_message(server):
    """message_start, the block's start, deltas and stop, message_delta, message_stop: the client's stream helper
    rebuilds the whole message, the deltas add up to it."""
    body = {"messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    whole = post(server, body).json()
    stream = events(server, body)
    kinds = [e["type"] for e in stream]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert streamed_blocks(stream) == whole_blocks(whole)
    assert stream[-2]["delta"]["stop_reason"] == whole["stop_reason"] == "max_tokens"
    assert stream[-2]["usage"]["output_tokens"] == 12
    with client(server).messages.stream(model="tiny", messages=body["messages"], max_tokens=12,
                                        extra_body={"ignore_eos": True, "temperature": 0}) as helper:
        rebuilt = helper.get_final_message()
    assert rebuilt.content[0].text == whole["content"][0]["text"] and rebuilt.stop_reason == "max_tokens"
    assert rebuilt.usage.output_tokens == 12


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_tool_use_whole_and_streamed(server, choice):
    """A forced tool and ``any``: tool_use blocks whose input follows the tool's schema, stop_reason tool_use;
    streamed, the input_json deltas add up to the same blocks, and the client's helper parses them."""
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS_A, "max_tokens": 60,
            "temperature": 0, "tool_choice": {**choice, "disable_parallel_tool_use": True}, **COMPACT}
    whole = post(server, body).json()
    (block,) = whole["content"]
    assert block["type"] == "tool_use" and whole["stop_reason"] == "tool_use", whole
    jsonschema.validate(block["input"], next(t["input_schema"] for t in TOOLS_A if t["name"] == block["name"]))
    assert compact(streamed_blocks(events(server, body))) == whole_blocks(whole)
    with client(server).messages.stream(model="tiny", messages=body["messages"], tools=TOOLS_A, max_tokens=60,
                                        tool_choice=body["tool_choice"], extra_body={**COMPACT, "temperature": 0}
                                        ) as helper:
        rebuilt = helper.get_final_message()
    assert rebuilt.content[0].input == block["input"] and rebuilt.stop_reason == "tool_use"


def test_auto_tool_use_follows_the_text(server):
    """``auto``: the hermes parser's calls out of the text (forced into hermes' form by a regex): a text block,
    then a tool_use block; streamed alike."""
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS_A, "max_tokens": 120,
            "temperature": 0, "structured_outputs": {"regex": HERMES}}
    whole = post(server, body).json()
    assert whole_blocks(whole) == [{"type": "text", "name": None, "text": "Sure. "},
                                   {"type": "tool_use", "name": "get_time", "text": '{"zone":"UTC"}'}]
    assert whole["stop_reason"] == "tool_use"
    assert compact(streamed_blocks(events(server, body))) == whole_blocks(whole)


def test_tool_use_and_tool_result_blocks_render_as_chat_messages(server):
    """An assistant turn's text, thinking and tool_use, a user turn's tool_result before its text: the same prompt
    and greedy answer as the chat messages they stand for (the agent loop of Anthropic's client)."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "weather?"}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "ask the tool", "signature": ""},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                                             {"type": "text", "text": "and now?"}]}]
    chat_messages = [{"role": "user", "content": "weather?"},
                     {"role": "assistant", "content": "Checking.", "reasoning_content": "ask the tool",
                      "tool_calls": [{"id": "t1", "type": "function", "function": {
                          "name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}}]},
                     {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
                     {"role": "user", "content": "and now?"}]
    message = client(server).messages.create(model="tiny", messages=messages, tools=TOOLS_A, max_tokens=6,
                                             tool_choice={"type": "none"}, extra_body={"temperature": 0})
    expected = chat(server, {"messages": chat_messages, "tools": TOOLS, "tool_choice": "none", "temperature": 0,
                             "max_completion_tokens": 6})
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == expected["usage"]["prompt_tokens"]
    assert message.content[0].text == expected["choices"][0]["message"]["content"]


def test_an_output_config_format(server):
    schema = TOOLS_A[0]["input_schema"]
    message = client(server).messages.create(model="tiny", messages=[{"role": "user", "content": "weather?"}],
                                             max_tokens=40, output_config={"format": {"type": "json_schema",
                                                                                      "schema": schema}},
                                             extra_body={**COMPACT, "temperature": 0})
    jsonschema.validate(json.loads(message.content[0].text), schema)
    assert message.stop_reason == "end_turn"


def test_a_reasoning_models_thinking_is_a_thinking_block(think_model_dirs):
    llm = LLM(think_model_dirs["target"], dtype="float64", max_num_seqs=2, reasoning_parser="deepseek_r1")
    served = Served(create_app(llm, served_model_name="tiny", api_key="", chat_template=TEMPLATE))
    try:
        close = str(llm.tokenizer.convert_tokens_to_ids("</think>"))
        body = {"messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 30, "temperature": 0,
                "logit_bias": {close: 0.2}, "structured_outputs": {"choice": ["yes", "no"]}}
        whole = post(served, body).json()
        thinking, text = whole["content"]
        assert thinking["type"] == "thinking" and len(thinking["thinking"]) > 0 and thinking["signature"] == ""
        assert text["text"] in ("yes", "no") and whole["stop_reason"] == "end_turn", whole
        assert streamed_blocks(events(served, body)) == whole_blocks(whole)
    finally:
        served.stop()


def test_an_api_key_in_anthropics_header(text_model_dirs):
    served = Served(create_app(LLM(text_model_dirs["target"], dtype="float64", max_num_seqs=1),
                               served_model_name="tiny", api_key="k", chat_template=TEMPLATE))
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        ok = anthropic.Anthropic(base_url=served.root, api_key="k").messages.create(model="tiny", **body)
        assert ok.usage.output_tokens == 1
        with pytest.raises(anthropic.AuthenticationError) as refused:
            anthropic.Anthropic(base_url=served.root, api_key="wrong", max_retries=0).messages.create(
                model="tiny", **body)
        assert refused.value.body["error"]["type"] == "authentication_error"
    finally:
        served.stop()


BAD = [
    ({"max_tokens": None}, "max_tokens is required"),
    ({"max_tokens": 0}, "max_tokens must be"),
    ({"messages": []}, "empty"),
    ({"system": 3}, "system must be a string or a list of"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0] must be"),
    ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0] must be"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "no images"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]}]},
     "messages[0].content[0] must be"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0]: text"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "custom tools only"),
    ({"tools": [{"name": "f"}]}, "tools[0]: input_schema"),
    ({"tools": TOOLS_A, "tool_choice": {"type": "tool"}}, "needs the tool's name"),
    ({"tools": TOOLS_A, "tool_choice": {"type": "tool", "name": "nope"}}, "not in tools"),
    ({"tool_choice": {"type": "any"}}, "no tools are given"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"temperature": -1}, "temperature"),
    ({"thinking": {"type": "sometimes"}}, "thinking"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "bogus"}}}}, "output_config.format"),
]


@pytest.mark.parametrize("extra, words", BAD, ids=[b[1] for b in BAD])
def test_bad_requests_are_a_400_in_anthropics_shape(server, extra, words):
    response = post(server, {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 2, **extra})
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert words.lower() in body["error"]["message"].lower(), body
    with pytest.raises(anthropic.BadRequestError):
        client(server).messages.create(model="tiny", **{"messages": [{"role": "user", "content": "weather?"}],
                                                        "max_tokens": 2}, extra_body=extra)


def test_other_errors_in_anthropics_shape(server):
    assert post(server, {"model": "other", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}).json()[
        "error"]["type"] == "not_found_error"
    response = httpx.post(f"{server.root}/v1/messages", content=b"{", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["type"] == "error"
    response = httpx.post(f"{server.root}/v1/messages", content=b"x", headers={"content-type": "text/plain"})
    assert response.status_code == 415 and response.json()["error"]["type"] == "invalid_request_error"
    openai_shape = post(server, {"prompt": "x", "max_tokens": 0}, route="completions").json()  # other routes: OpenAI's
    assert set(openai_shape) == {"error"} and openai_shape["error"]["param"] == "max_tokens"
