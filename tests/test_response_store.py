"""Stored responses (:mod:`specdec.server.response_store`): a request with ``previous_response_id`` is answered as
the whole conversation sent again would be (its prompt read from the prefix cache), whether the earlier turn was
text, a streamed answer or a tool call; stored responses are read, listed and deleted through OpenAI's client; the
store keeps the most recently used; ``store: false`` keeps nothing; every bad id, page or setting is a clear error."""

from __future__ import annotations

import argparse

import httpx
import openai
import pytest
from test_responses import FLAT, FORCED, events, post
from test_server import TEMPLATE, Served, draft_dir  # noqa: F401
from test_tools import COMPACT, SPEC, hermes_app, make_llm

from specdec.cli import build_parser
from specdec.errors import SpecDecError
from specdec.server import create_app
from specdec.server.cli import _stored_responses
from specdec.server.protocol import APIError
from specdec.server.response_store import DEFAULT_CAPACITY, ResponseStore
from specdec.server.responses_request import ResponsesRequest


@pytest.fixture(scope="module")
def server(text_model_dirs, draft_dir):  # noqa: F811
    served = Served(hermes_app(text_model_dirs, draft_dir))
    yield served
    served.stop()


def text_of(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


def test_a_continuation_is_answered_as_the_whole_conversation(server):
    """The second turn by ``previous_response_id`` gets the prompt and the greedy answer of the whole conversation
    sent as input, its prompt's first tokens read from the prefix cache; a turn's ``instructions`` are its own
    (not carried over, as in OpenAI's API)."""
    brief = {"instructions": "be brief", "temperature": 0, "max_output_tokens": 8, "ignore_eos": True}
    first = post(server, {**brief, "input": "weather in Oslo?"}).json()
    assert first["store"] is True and first["previous_response_id"] is None
    second = post(server, {**brief, "previous_response_id": first["id"], "input": "and in Rome?"}).json()
    assert second["previous_response_id"] == first["id"] and second["store"] is True
    history = [{"role": "user", "content": "weather in Oslo?"}, *first["output"]]
    whole = post(server, {**brief, "input": [*history, {"role": "user", "content": "and in Rome?"}],
                          "store": False}).json()
    assert second["usage"]["input_tokens"] == whole["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    assert text_of(second) == text_of(whole) and text_of(second)
    assert second["usage"]["input_tokens_details"]["cached_tokens"] > 0
    third = post(server, {"previous_response_id": second["id"], "input": "thanks", "temperature": 0,
                          "max_output_tokens": 4}).json()
    assert third["instructions"] is None
    again = post(server, {"temperature": 0, "max_output_tokens": 4, "store": False,
                          "input": [*history, {"role": "user", "content": "and in Rome?"}, *second["output"],
                                    {"role": "user", "content": "thanks"}]}).json()
    assert third["usage"]["input_tokens"] == again["usage"]["input_tokens"] and text_of(third) == text_of(again)


def test_a_tool_calls_output_continues_it(server):
    """A forced call, then its output by ``previous_response_id``: the prompt of the call and its output sent whole."""
    call = post(server, {"input": "weather?", "tools": FLAT, "tool_choice": FORCED, "temperature": 0,
                         "max_output_tokens": 60, **COMPACT}).json()
    (item,) = call["output"]
    output = {"type": "function_call_output", "call_id": item["call_id"], "output": "sunny"}
    body = {"tools": FLAT, "tool_choice": "none", "temperature": 0, "max_output_tokens": 6}
    continued = post(server, {**body, "previous_response_id": call["id"], "input": [output]}).json()
    whole = post(server, {**body, "input": [{"role": "user", "content": "weather?"}, item, output],
                          "store": False}).json()
    assert continued["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    assert text_of(continued) == text_of(whole)


def test_a_stream_is_stored_once_it_completes(server):
    stream = events(server, {"input": "def f(x):", "temperature": 0, "max_output_tokens": 6})
    final = stream[-1]["response"]
    assert final["store"] is True
    assert httpx.get(f"{server.root}/v1/responses/{final['id']}").json() == final


def test_read_list_and_delete_through_openai_client(server):
    client = server.client()
    items = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
             {"role": "user", "content": [{"type": "input_text", "text": "three"}]}]
    created = client.responses.create(model="tiny", input=items, temperature=0, max_output_tokens=3)
    assert client.responses.retrieve(created.id).model_dump() == created.model_dump()
    listed = list(client.responses.input_items.list(created.id, order="asc", limit=2))  # pages of 2
    assert [(i.role, i.content[0].text, i.content[0].type) for i in listed] == [
        ("user", "one", "input_text"), ("assistant", "two", "output_text"), ("user", "three", "input_text")]
    assert len({i.id for i in listed}) == 3 and all(i.id.startswith("msg_") for i in listed)
    newest = client.responses.input_items.list(created.id, limit=1)
    assert [i.content[0].text for i in newest.data] == ["three"] and newest.has_more
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(created.id)
    assert gone.value.body["code"] == "response_not_found" and created.id in gone.value.body["message"]
    with pytest.raises(openai.BadRequestError) as lost:
        client.responses.create(model="tiny", input="four", previous_response_id=created.id)
    assert lost.value.body["code"] == "previous_response_not_found"
    assert lost.value.body["param"] == "previous_response_id"
    for method in ("get", "delete"):
        assert httpx.request(method, f"{server.root}/v1/responses/{created.id}").status_code == 404


def test_store_false_keeps_nothing(server):
    response = post(server, {"input": "hi", "max_output_tokens": 2, "store": False}).json()
    assert response["store"] is False
    assert httpx.get(f"{server.root}/v1/responses/{response['id']}").status_code == 404
    again = post(server, {"input": "hi", "max_output_tokens": 2, "previous_response_id": response["id"]})
    assert again.status_code == 400 and again.json()["error"]["code"] == "previous_response_not_found"


BAD_READS = [
    ("/input_items?limit=0", "limit"), ("/input_items?limit=101", "limit"), ("/input_items?limit=x", "limit"),
    ("/input_items?order=up", "order"), ("/input_items?after=msg_nope", "after"), ("?stream=true", "stream"),
]


@pytest.mark.parametrize("suffix, param", BAD_READS, ids=[b[0] for b in BAD_READS])
def test_bad_reads_are_a_400_naming_the_parameter(server, suffix, param):
    created = post(server, {"input": "hi", "max_output_tokens": 2}).json()
    response = httpx.get(f"{server.root}/v1/responses/{created['id']}{suffix}")
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    cancel = httpx.post(f"{server.root}/v1/responses/{created['id']}/cancel")
    assert cancel.status_code == 400 and "background" in cancel.json()["error"]["message"]


def request(text: str, previous: str | None = None) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": text, "previous_response_id": previous})


def stored(store: ResponseStore, id_: str, text: str = "x") -> None:
    output = [{"type": "message", "id": "msg_" + id_, "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": text, "annotations": []}]}]
    store.add({"id": id_, "output": output}, store.turn(request("q" + id_)))


def context(store: ResponseStore, id_: str) -> list[str]:
    """The texts a request continuing ``id_`` starts from."""
    return [item.text() for item in store.turn(request("next", id_)).context]


def test_the_store_drops_the_least_recently_used():
    """Capacity 2: continuing ``a`` makes it recent, so storing ``c`` drops ``b``; a continuation's context holds
    the earlier turns even when the first is dropped."""
    store = ResponseStore(2)
    stored(store, "a", "A")
    stored(store, "b")
    assert context(store, "a") == ["qa", "A"]
    stored(store, "c")
    assert len(store) == 2 and store.response("a")["id"] == "a"
    with pytest.raises(APIError) as dropped:
        context(store, "b")
    assert dropped.value.status == 400 and "2 most recently used" in dropped.value.message
    store.add({"id": "d", "output": []}, store.turn(request("qd", "a")))
    store.delete("a")
    assert context(store, "d") == ["qa", "A", "qd"]
    with pytest.raises(APIError) as missing:
        store.delete("a")
    assert missing.value.status == 404


def test_a_server_that_stores_nothing(text_model_dirs, draft_dir, capsys):  # noqa: F811
    """``max_stored_responses=0``: responses say they are not stored, a continuation is a 400 that says why; a bad
    setting is refused when the app is made, and several replicas store nothing unless told, and cannot be told."""
    llm = make_llm(text_model_dirs, draft_dir, SPEC)
    app = create_app(llm, served_model_name="tiny", chat_template=TEMPLATE, max_stored_responses=0, api_key="")
    served = Served(app)
    try:
        response = post(served, {"input": "hi", "max_output_tokens": 2}).json()
        assert response["store"] is False
        again = post(served, {"input": "hi", "previous_response_id": response["id"]})
        assert again.status_code == 400 and "stores no responses" in again.json()["error"]["message"]
    finally:
        served.stop()
    with pytest.raises(SpecDecError, match="max_stored_responses"):
        create_app(llm, max_stored_responses=-1)

    def flags(value, replicas=None, max_replicas=None):
        settings = None if replicas is None else argparse.Namespace(num_replicas=replicas, max_replicas=max_replicas)
        return _stored_responses(argparse.Namespace(max_stored_responses=value), settings)

    assert (flags(None), flags(5), flags(None, 1), flags(None, 2), flags(None, 1, 4), flags(0, 3)) == (
        DEFAULT_CAPACITY, 5, DEFAULT_CAPACITY, 0, 0, 0)
    # the help names the default as a literal (importing the store would import torch): it must be the store's
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"(default {DEFAULT_CAPACITY}, and none with more than one replica" in help_text
    with pytest.raises(SpecDecError, match="single replica"):
        flags(8, 2)
