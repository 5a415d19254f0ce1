"""vLLM's ``/tokenize`` and ``/detokenize``: a prompt's tokens as a completion feeds them, a conversation's as a chat
feeds them (tools included), tokens back to text, a 400 naming the field for every bad input, the API key honoured."""

from __future__ import annotations

import httpx
import pytest
from test_server import PLAIN, TEMPLATE, Served, draft_dir, make_llm  # noqa: F401

from specdec import SamplingParams
from specdec.server import create_app

TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
CHAT = [{"role": "user", "content": "def f(x):"}]


@pytest.fixture(scope="module")
def server(text_model_dirs, draft_dir):  # noqa: F811
    llm = make_llm(text_model_dirs, draft_dir, PLAIN)
    served = Served(create_app(llm, served_model_name="tiny", api_key="key", chat_template=TEMPLATE))
    served.llm = llm
    yield served
    served.stop()


def post(server, route: str, body: dict, key: str | None = "key") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.root}/{route}", json=body, headers=headers, timeout=60)


def test_tokens_are_what_a_request_would_feed(server):
    prompt = "for i in range(10):\n    print("
    got = post(server, "tokenize", {"model": "tiny", "prompt": prompt, "return_token_strs": True}).json()
    fed = server.llm.generate(prompt, SamplingParams(max_tokens=1))[0].prompt_token_ids
    assert got["tokens"] == fed and got["count"] == len(fed) and got["max_model_len"] == server.llm.max_model_len
    assert len(got["token_strs"]) == len(fed)
    assert post(server, "detokenize", {"tokens": fed}).json() == {"prompt": prompt}
    chat = post(server, "tokenize", {"messages": CHAT, "tools": TOOLS}).json()
    rendered = server.llm.chat(CHAT, SamplingParams(max_tokens=1), chat_template=TEMPLATE, tools=TOOLS)[0]
    assert chat["tokens"] == rendered.prompt_token_ids and chat["token_strs"] is None
    opened = post(server, "tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert opened["count"] < chat["count"]


@pytest.mark.parametrize("route, body, param, status", [
    ("tokenize", {"prompt": 3}, "prompt", 400),
    ("tokenize", {"prompt": "x", "colour": 1}, "colour", 400),
    ("tokenize", {"messages": []}, "messages", 400),
    ("tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools", 400),
    ("tokenize", {"prompt": "x", "model": "other"}, "model", 404),
    ("detokenize", {"tokens": [10**9]}, "tokens", 400),
    ("detokenize", {"tokens": []}, "tokens", 400),
    ("detokenize", {"tokens": "abc"}, "tokens", 400),
])
def test_bad_inputs_are_named(server, route, body, param, status):
    response = post(server, route, body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_the_api_key_is_required(server):
    assert post(server, "tokenize", {"prompt": "x"}, key=None).status_code == 401
    assert post(server, "detokenize", {"tokens": [1]}, key="wrong").status_code == 401
