"""``--reasoning-parser``: a chat output split into ``reasoning_content`` and ``content`` (whole and streamed, every
piece size giving the whole split), the answer going on to the tool-call parser, a constrained output all content."""

from __future__ import annotations

import json

import httpx
import pytest
from test_server import SPEC, TEMPLATE, Served, draft_dir, make_llm  # noqa: F401

from specdec import SpecDecError
from specdec.server import create_app
from specdec.server.reasoning import PARSERS, ReasoningSplit

CASES = [  # text, deepseek_r1's (reasoning, content), qwen3's
    ("plan</think>answer", ("plan", "answer"), ("", "plan</think>answer")),
    ("<think>plan</think>\n\nanswer", ("plan", "\n\nanswer"), ("plan", "\n\nanswer")),
    ("  <think>still thinking", ("still thinking", ""), ("still thinking", "")),
    ("just an answer", ("just an answer", ""), ("", "just an answer")),
    ("a </thin", ("a </thin", ""), ("", "a </thin")),
    ("<thi", ("<thi", ""), ("", "<thi")),
    ("x</think>", ("x", ""), ("", "x</think>")),
    ("<think></think>y</think>z", ("", "y</think>z"), ("", "y</think>z")),
]


@pytest.mark.parametrize("text, r1, qwen3", CASES)
def test_a_split_streamed_in_pieces_of_any_size_is_the_whole_split(text, r1, qwen3):
    for name, expected in (("deepseek_r1", r1), ("qwen3", qwen3)):
        assert ReasoningSplit(PARSERS[name]).split(text) == expected, name
        for size in (1, 2, 5, 100):
            split = ReasoningSplit(PARSERS[name])
            pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
            sent = [split.feed(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
            assert ("".join(r for r, _ in sent), "".join(c for _, c in sent)) == expected, (name, size)
            partial = ReasoningSplit(PARSERS[name])
            for i in range(len(text) + 1):  # what a partial output sends is a prefix of the whole output's parts
                reasoning, content = partial.split(text[:i], final=False)
                assert expected[0].startswith(reasoning) and expected[1].startswith(content)
    assert ReasoningSplit(True).message("only thoughts") == ("only thoughts", "")
    assert ReasoningSplit(False).message("an answer") == (None, "an answer")


@pytest.fixture(scope="module")
def server(text_model_dirs, draft_dir):  # noqa: F811
    served = Served(create_app(make_llm(text_model_dirs, draft_dir, SPEC), served_model_name="tiny", api_key="",
                               chat_template=TEMPLATE, reasoning_parser="deepseek_r1"))
    yield served
    served.stop()


def post(server, body: dict) -> dict:
    response = httpx.post(f"{server.root}/v1/chat/completions", json={"model": "tiny", **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_server_splits_thinking_from_the_answer(server):
    """deepseek_r1: a random model's output never closes its thinking, so it is all reasoning, content null; streamed,
    the reasoning deltas add up to it; a constrained output is all content."""
    body = {"messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    message = post(server, body)["choices"][0]["message"]
    assert message["content"] is None and len(message["reasoning_content"]) > 0
    with httpx.stream("POST", f"{server.root}/v1/chat/completions",
                      json={"model": "tiny", "stream": True, **body}, timeout=60) as response:
        deltas = [c["delta"] for line in response.iter_lines() if line.startswith("data: {")
                  for c in json.loads(line[6:])["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    constrained = post(server, {**body, "guided_choice": ["yes", "no"]})["choices"][0]["message"]
    assert constrained["content"] in ("yes", "no") and "reasoning_content" not in constrained


def test_an_unknown_parser_is_refused(text_model_dirs, draft_dir):  # noqa: F811
    with pytest.raises(SpecDecError, match="unknown reasoning parser 'r2'"):
        create_app(make_llm(text_model_dirs, draft_dir, SPEC), reasoning_parser="r2")


def test_an_assistants_reasoning_reaches_the_template(server):
    """A client may send an assistant's ``reasoning_content`` back; the template gets it (Qwen3's renders it)."""
    from specdec.chat import conversation_of, render

    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "why"}]
    template = "{% for m in messages %}{{ m.role }}:{{ m.reasoning_content or '' }}|{{ m.content }};{% endfor %}"
    assert render(server.state.llm.tokenizer, conversation_of(messages), template, False) == (
        "user:|q;assistant:why|a;")
    answer = post(server, {"messages": messages, "max_tokens": 2, "ignore_eos": True})
    assert answer["choices"][0]["finish_reason"] == "length"
