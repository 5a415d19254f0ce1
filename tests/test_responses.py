"""The Responses API (``POST /v1/responses``): a response holds what the chat endpoint answers to the same request
(text, tool calls, reasoning, usage); its event stream, read by OpenAI's client, builds the same response; earlier
calls and their outputs in ``input`` render as the chat messages they are; what the server does not do is a 400
naming the Responses field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from test_reasoning import post as chat
from test_server import TEMPLATE, Served, draft_dir  # noqa: F401
from test_tools import COMPACT, HERMES, TOOLS, WEATHER, hermes_app

from specdec import LLM
from specdec.server import create_app
from specdec.server.chat_output import ChatOutputs
from specdec.server.chat_request import ChatRequest
from specdec.server.responses import ResponseShape
from specdec.server.responses_request import ResponsesRequest
from specdec.tools import HermesParser

FLAT = [{"type": "function", **tool["function"]} for tool in TOOLS]  # the Responses API's tools are flat
FORCED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def server(text_model_dirs, draft_dir):  # noqa: F811
    served = Served(hermes_app(text_model_dirs, draft_dir))
    yield served
    served.stop()


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.root}/v1/responses", json={"model": "tiny", **body}, timeout=60)


def typed_events(server, route: str, body: dict) -> list[dict]:
    """A stream of typed events (the Responses and Messages APIs'); each ``event:`` line names its data's type."""
    with httpx.stream("POST", f"{server.root}/v1/{route}", json={"model": "tiny", "stream": True, **body},
                      timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert len(lines) % 2 == 0 and "[DONE]" not in "".join(lines)
    out = [json.loads(data.removeprefix("data: ")) for data in lines[1::2]]
    assert [name.removeprefix("event: ") for name in lines[::2]] == [event["type"] for event in out]
    return out


def events(server, body: dict) -> list[dict]:
    out = typed_events(server, "responses", body)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def streamed_output(events: list[dict]) -> list[dict]:
    """The output items assembled from the deltas alone (text and arguments), as a client without the helpers does."""
    items: dict[int, dict] = {}
    for event in events:
        kind = event["type"]
        if kind == "response.output_item.added":
            item = event["item"]  # as it begins: empty
            assert item.get("content", []) == [] and item.get("arguments", "") == "" and item["status"] == "in_progress"
            items[event["output_index"]] = {"type": item["type"], "text": "", "name": item.get("name")}
        elif kind in ("response.output_text.delta", "response.reasoning_text.delta",
                      "response.function_call_arguments.delta"):
            items[event["output_index"]]["text"] += event["delta"]
    return [items[i] for i in sorted(items)]


def whole_output(response: dict) -> list[dict]:
    return [{"type": item["type"], "name": item.get("name"),
             "text": item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]}
            for item in response["output"]]


def test_a_response_holds_the_chat_answer(server):
    """Text through OpenAI's client: the answer, usage and status equal the chat endpoint's for the same messages;
    an output cut at ``max_output_tokens`` is incomplete."""
    client = server.client()
    response = client.responses.create(model="tiny", instructions="be brief", input="weather?", temperature=0,
                                       max_output_tokens=8, extra_body={"ignore_eos": True})
    expected = chat(server, {"messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "weather?"}],
                             "temperature": 0, "max_completion_tokens": 8, "ignore_eos": True})
    assert response.output_text == expected["choices"][0]["message"]["content"]
    assert (response.status, response.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert (response.usage.input_tokens, response.usage.output_tokens) == (expected["usage"]["prompt_tokens"], 8)
    assert response.usage.total_tokens == expected["usage"]["total_tokens"] and response.id.startswith("resp_")
    assert [item.type for item in response.output] == ["message"] and response.output[0].role == "assistant"
    assert response.store is True and response.model == "tiny" and response.instructions == "be brief"
    stopped = client.responses.create(model="tiny", instructions="be brief", input="weather?", temperature=0,
                                      max_output_tokens=30, extra_body={"stop": [response.output_text[-2:]]})
    assert stopped.status == "completed" and stopped.incomplete_details is None


def test_the_stream_builds_the_same_response(server):
    """The typed events (created, in_progress, item and part added, deltas, their done events, incomplete): the
    client's stream helper rebuilds the whole response, the deltas add up to it."""
    body = {"input": "def f(x):", "temperature": 0, "max_output_tokens": 12, "ignore_eos": True}
    whole = post(server, body).json()
    stream = events(server, body)
    kinds = [e["type"] for e in stream]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    final = stream[-1]["response"]
    assert whole_output(final) == whole_output(whole) == streamed_output(stream)
    assert final["usage"]["output_tokens"] == whole["usage"]["output_tokens"] == 12
    text = whole["output"][0]["content"][0]["text"]
    stop = {"stop": [text[-2:]]}  # the client's stream helper wants a completed response
    with server.client().responses.stream(model="tiny", input=body["input"], temperature=0, max_output_tokens=30,
                                          extra_body=stop) as helper:
        rebuilt = helper.get_final_response()
    assert rebuilt.status == "completed" and text.startswith(rebuilt.output_text)
    assert rebuilt.output_text == post(server, {**body, **stop, "max_output_tokens": 30}).json()["output"][0][
        "content"][0]["text"]


@pytest.mark.parametrize("choice", [FORCED, "required"])
def test_function_calls_whole_and_streamed(server, choice):
    """A forced call and ``required``'s calls are ``function_call`` items whose arguments follow the tool's schema;
    streamed, the argument deltas add up to the same items."""
    body = {"input": "weather?", "tools": FLAT, "tool_choice": choice, "temperature": 0, "max_output_tokens": 60,
            "parallel_tool_calls": False, **COMPACT}
    response = post(server, body).json()
    assert response["status"] == "completed", response
    (call,) = response["output"]
    assert call["type"] == "function_call" and call["call_id"] and call["status"] == "completed"
    schema = next(t["parameters"] for t in FLAT if t["name"] == call["name"])
    jsonschema.validate(json.loads(call["arguments"]), schema)
    stream = events(server, body)
    assert whole_output(stream[-1]["response"]) == whole_output(response) == streamed_output(stream)
    done = [e for e in stream if e["type"] == "response.function_call_arguments.done"]
    assert [e["arguments"] for e in done] == [call["arguments"]]


def test_auto_calls_follow_the_text(server):
    """``tool_choice`` auto: the hermes parser's calls out of the text (forced into hermes' form by a regex, as a
    random model writes none): a message item, then a function_call item; streamed alike."""
    body = {"input": "weather?", "tools": FLAT, "temperature": 0, "max_output_tokens": 120,
            "structured_outputs": {"regex": HERMES}}
    response = post(server, body).json()
    assert whole_output(response) == [{"type": "message", "name": None, "text": "Sure. "},
                                      {"type": "function_call", "name": "get_time", "text": '{"zone":"UTC"}'}]
    assert response["status"] == "completed"
    assert streamed_output(events(server, body)) == whole_output(response)


def test_earlier_calls_and_their_outputs_render_as_chat_messages(server):
    """``function_call`` and ``function_call_output`` items (and an assistant message echoed back) are the chat
    conversation they stand for: the same prompt and the same greedy answer."""
    arguments = '{"city": "Oslo"}'
    items = [{"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": arguments},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    response = post(server, {"input": items, "tools": FLAT, "tool_choice": "none", "temperature": 0,
                             "max_output_tokens": 6}).json()
    expected = chat(server, {"messages": messages, "tools": TOOLS, "tool_choice": "none", "temperature": 0,
                             "max_completion_tokens": 6})
    assert response["usage"]["input_tokens"] == expected["usage"]["prompt_tokens"]
    assert response["output"][0]["content"][0]["text"] == expected["choices"][0]["message"]["content"]


def test_a_json_schema_text_format(server):
    schema = WEATHER["function"]["parameters"]
    response = post(server, {"input": "weather?", "temperature": 0, "max_output_tokens": 40, **COMPACT,
                             "text": {"format": {"type": "json_schema", "name": "w", "schema": schema}}}).json()
    jsonschema.validate(json.loads(response["output"][0]["content"][0]["text"]), schema)
    assert response["text"]["format"]["name"] == "w"


def test_the_shape_of_a_stream_equals_the_whole_for_every_split():
    """ResponseShape fed a hermes output in pieces of every size builds the items of the whole output."""
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
    req = ResponsesRequest(input="weather?", tools=FLAT, stream=True)
    chat_req = ChatRequest.model_validate(req.chat_body())

    def shaped(size: int) -> list[dict]:
        shape = ResponseShape(req, "tiny", ChatOutputs(chat_req, HermesParser(), None))
        stream = []
        for start in range(0, len(text), size):
            end = start + size
            finish = "stop" if end >= len(text) else None
            stream += shape.feed(shape.chat.delta(0, text[start:end], finish)[0])
        usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
        return stream + shape.finish("tool_calls", None, usage)[0]

    for size in (1, 3, 7, len(text)):
        stream = shaped(size)
        assert [e["sequence_number"] for e in stream] == list(range(len(stream)))
        output = whole_output(stream[-1]["response"])
        assert output == streamed_output(stream)
        assert [(o["type"], o["name"]) for o in output] == [("message", None), ("function_call", "get_weather"),
                                                           ("function_call", "get_time")]
        assert output[0]["text"] == "Let me check. " and json.loads(output[1]["text"]) == {"city": "Oslo"}


def test_reasoning_items_go_back_with_the_next_assistant_message():
    req = ResponsesRequest(input=[{"role": "user", "content": "q"},
                                  {"type": "reasoning", "summary": [], "content": [
                                      {"type": "reasoning_text", "text": "why"}]},
                                  {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
                                  {"type": "function_call", "call_id": "b", "name": "g", "arguments": "{}"},
                                  {"type": "function_call_output", "call_id": "a", "output": "1"}],
                           instructions="sys")
    assert req.messages() == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "reasoning_content": "why", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "1"}]


def test_a_reasoning_models_thinking_is_a_reasoning_item(think_model_dirs):
    """deepseek_r1: the thinking is a ``reasoning`` item before the answer's message, whole and streamed."""
    llm = LLM(think_model_dirs["target"], dtype="float64", max_num_seqs=2, reasoning_parser="deepseek_r1")
    served = Served(create_app(llm, served_model_name="tiny", api_key="", chat_template=TEMPLATE))
    try:
        close = str(llm.tokenizer.convert_tokens_to_ids("</think>"))
        body = {"input": "def f(x):", "temperature": 0, "max_output_tokens": 30, "logit_bias": {close: 0.2},
                "structured_outputs": {"choice": ["yes", "no"]}}
        response = post(served, body).json()
        reasoning, message = response["output"]
        assert reasoning["type"] == "reasoning" and len(reasoning["content"][0]["text"]) > 0
        assert message["content"][0]["text"] in ("yes", "no") and response["status"] == "completed", response
        stream = events(served, body)
        assert streamed_output(stream) == whole_output(response) == whole_output(stream[-1]["response"])
    finally:
        served.stop()


BAD = [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "not found"),
    ({"background": True}, "background", "false"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "function tools only"),
    ({"tools": [{"type": "function"}]}, "tools[0]", "must be"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0]", "no images"),
    ({"input": []}, "input", "empty"),
    ({"input": 3}, "input", "a string or a list of items"),
    ({"input": [{"type": ["message"]}]}, "input[0]", "must be an item"),  # was a 500 (found by the fuzzer)
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content",
     "input[0]"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id", "field required"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "needs a schema"),
    ({"tools": FLAT, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "not in tools"),
    ({"tool_choice": 3}, "tool_choice", "tool_choice"),
    ({"top_logprobs": 5}, "top_logprobs", "0"),
    ({"truncation": "auto"}, "truncation", "disabled"),
    ({"temperature": -1}, "temperature", "temperature"),
    ({"reasoning": {"budget": 3}}, "reasoning", "effort and summary"),
]


@pytest.mark.parametrize("extra, param, words", BAD, ids=[b[1] for b in BAD])
def test_bad_requests_are_a_400_naming_the_responses_field(server, extra, param, words):
    response = post(server, {"input": "weather?", "max_output_tokens": 2, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words.lower() in error["message"].lower(), error
    assert error["type"] == "invalid_request_error"


def test_an_unknown_model_is_a_404(server):
    response = post(server, {"input": "weather?", "model": "other"})
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"
