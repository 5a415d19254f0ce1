"""``--reasoning-parser``: a chat output split into ``reasoning_content`` and ``content`` (whole and streamed, every
piece size giving the whole split); a constrained output thinks first and its content is the constrained answer, a
forced tool call is read from the answer."""

from __future__ import annotations

import json

import httpx
import pytest
from test_server import TEMPLATE, Served
from test_tools import COMPACT, FORCED, TOOLS

from specdec import LLM
from specdec.reasoning import PARSERS, ReasoningSplit
from specdec.server import create_app

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
def server(think_model_dirs):
    """A reasoning model's shape (``<think>`` and ``</think>`` single tokens) with draft_model speculation."""
    llm = LLM(think_model_dirs["target"], dtype="float64", max_num_seqs=4, reasoning_parser="deepseek_r1",
              speculative_config={"method": "draft_model", "model": str(think_model_dirs["draft"]),
                                  "num_speculative_tokens": 3})
    served = Served(create_app(llm, served_model_name="tiny", api_key="", chat_template=TEMPLATE))
    yield served
    served.stop()


def post(server, body: dict) -> dict:
    response = httpx.post(f"{server.root}/v1/chat/completions", json={"model": "tiny", **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(server, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.root}/v1/chat/completions",
                      json={"model": "tiny", "stream": True, **body}, timeout=60) as response:
        return [c["delta"] for line in response.iter_lines() if line.startswith("data: {")
                for c in json.loads(line[6:])["choices"]]


def close_bias(server, bias: float) -> dict:
    """``logit_bias`` on ``</think>``: a random model closes its thinking after a few tokens."""
    tokenizer = server.state.llm.tokenizer
    return {"logit_bias": {str(tokenizer.convert_tokens_to_ids("</think>")): bias}}


def test_the_server_splits_thinking_from_the_answer(server):
    """deepseek_r1: a random model's output that never closes its thinking is all reasoning, content null; streamed,
    the reasoning deltas add up to it."""
    body = {"messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    message = post(server, body)["choices"][0]["message"]
    assert message["content"] is None and len(message["reasoning_content"]) > 0
    deltas = streamed(server, body)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == ""


def test_a_constrained_answer_follows_the_thinking(server):
    """The constraint holds for the content after </think>; the thinking before it is free: whole and streamed."""
    body = {"messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 30, "temperature": 0,
            "guided_choice": ["yes", "no"], **close_bias(server, 0.2)}
    answer = post(server, body)["choices"][0]
    message = answer["message"]
    assert message["content"] in ("yes", "no") and answer["finish_reason"] == "stop", answer
    assert len(message["reasoning_content"]) > 0 and "</think>" not in message["reasoning_content"]
    deltas = streamed(server, body)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]


def test_after_a_prompt_that_closed_the_thinking_all_is_content(server):
    """A prompt that closes the thinking (here an assistant turn continued after an empty thinking, as templates with
    the thinking off write it): the output is the answer, constrained from its first token, and all content."""
    body = {"messages": [{"role": "user", "content": "def f(x):"},
                         {"role": "assistant", "content": "<think>\n\n</think>\n\n"}],
            "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 30, "temperature": 0,
            "guided_choice": ["yes", "no"]}  # without the prompt's close, a random model thinks past max_tokens
    answer = post(server, body)["choices"][0]
    assert answer["message"]["content"] in ("yes", "no") and "reasoning_content" not in answer["message"], answer


def test_a_forced_tool_call_follows_the_thinking(server):
    body = {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 40, "temperature": 0,
            "tools": TOOLS, "tool_choice": FORCED, **COMPACT, **close_bias(server, 0.2)}
    answer = post(server, body)["choices"][0]
    message = answer["message"]
    assert len(message["reasoning_content"]) > 0, answer
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Oslo", "Lima")


def test_an_assistants_reasoning_reaches_the_template(server):
    """A client may send an assistant's ``reasoning_content`` back; the template gets it (Qwen3's renders it)."""
    from specdec.chat import conversation_of, render

    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "why"}]
    template = "{% for m in messages %}{{ m.role }}:{{ m.reasoning_content or '' }}|{{ m.content }};{% endfor %}"
    assert render(server.state.llm.tokenizer, conversation_of(messages), template, False) == (
        "user:|q;assistant:why|a;")
    answer = post(server, {"messages": messages, "max_tokens": 2, "ignore_eos": True})
    assert answer["choices"][0]["finish_reason"] == "length"
