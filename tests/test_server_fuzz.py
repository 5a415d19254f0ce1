"""Bad requests against a served tiny model: each class the server once answered with a 500, a 429
or a wrong 200 gets a 4xx in OpenAI's shape that names the problem, and a fuzzer sends a few hundred
generated bodies to the completions, chat, Responses and Messages endpoints (surrogates, huge
integers, deep nesting, odd types, every field) with 0 x 500 and no traceback in the log."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import TEMPLATE, Served

from specdec import LLM
from specdec.server import create_app

ERROR_KEYS = {"message", "type", "param", "code"}
MAX_SEQS, QUEUE, CONTEXT = 2, 2, 192


@pytest.fixture(scope="module")
def served(text_model_dirs):
    llm = LLM(text_model_dirs["target"], dtype="float64", max_num_seqs=MAX_SEQS)
    server = Served(create_app(llm, served_model_name="tiny", api_key="", chat_template=TEMPLATE,
                               max_queue_len=QUEUE))
    yield server
    server.stop()


def post(served, route: str, body: bytes | dict | str) -> httpx.Response:
    if isinstance(body, dict):
        body = json.dumps(body)  # ensure_ascii: a lone surrogate travels as its \\u escape
    if isinstance(body, str):
        body = body.encode()
    return httpx.post(f"{served.root}/v1/{route}", content=body, headers={"content-type": "application/json"},
                      timeout=60)


def error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text[:500]
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS
    assert "Traceback" not in body["error"]["message"]
    return body["error"]


CHAT = "chat/completions"
COMPLETIONS = "completions"
RESPONSES = "responses"
ANTHROPIC = "messages"  # Anthropic's Messages API: its errors in Anthropic's shape
SURROGATE = "\ud800"
BAD = [
    # (route, body, words the message must contain, param)
    (CHAT, {"messages": [{"role": "user", "content": SURROGATE}], "max_tokens": 2}, "surrogate",
     "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a" + SURROGATE}]}]}, "surrogate",
     "messages[0].content[0].text"),
    (CHAT, {"messages": [{"role": "system", "content": SURROGATE}, {"role": "user", "content": "hi"}]},
     "surrogate", "messages[0].content"),
    (COMPLETIONS, {"prompt": "x", "stop": ["a" + SURROGATE]}, "surrogate", "stop[0]"),
    (COMPLETIONS, {"prompt": "x", "max" + SURROGATE: 1}, "field name", None),
    (COMPLETIONS, '{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}", "4300 digits", None),
    (CHAT, '{"messages": [], "seed": ' + "1" * 4400 + "}", "4300 digits", None),
    (COMPLETIONS, "[" * 100_000 + "]" * 100_000, "nested", None),
    (COMPLETIONS, '{"prompt": "x", "deep": ' + "[" * 70 + "]" * 70 + "}", "nested more than 64", "deep" + "[0]" * 63),
    (COMPLETIONS, json.dumps({"prompt": "x"}).encode("utf-16"), "UTF-8", None),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens", "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_tokens",
     "max_completion_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [10**6]}, "vocabulary",
     "stop_token_ids"),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [5, 10**6]}, "vocabulary", "stop_token_ids"),
    (COMPLETIONS, {"prompt": ["a", "b", "c"], "n": 2}, f"at most {MAX_SEQS + QUEUE}", "prompt"),
    (COMPLETIONS, {"prompt": "x", "n": 5}, f"at most {MAX_SEQS + QUEUE}", "n"),
    (COMPLETIONS, {"prompt": "x", "best_of": 2}, "best_of", "best_of"),
    (COMPLETIONS, {"prompt": "x", "response_format": {"type": "xml"}}, "response_format",
     "response_format.type"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs must be null or an integer in 0..20", "logprobs"),
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": 2, "stream": True}, "whole response", "prompt_logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "logprobs is not true",
     "top_logprobs"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 100_000}, f"maximum length is {CONTEXT}", "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000}, f"{CONTEXT} tokens",
     "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, "at most 16", "stop"),
    (COMPLETIONS, {"prompt": "x", "stop": "s" * 257}, "at most 256", "stop"),
    (COMPLETIONS, {"prompt": "x" * (32 * CONTEXT + 1)}, f"at most {32 * CONTEXT} bytes", "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "€" * (11 * CONTEXT)}]}, f"at most {32 * CONTEXT} bytes",
     "messages"),
    (COMPLETIONS, {"prompt": [1] * 1000}, "too long", "prompt"),
    (COMPLETIONS, {"prompt": [10**6]}, "outside the vocabulary", "prompt"),
    (COMPLETIONS, {"prompt": ""}, "empty prompt", "prompt"),
    (COMPLETIONS, {"prompt": "x", "seed": 2**64 - 1, "n": 2}, "seed + n - 1 must be at most 2**64-1", "seed"),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, "only allowed when stream is true",
     "stream_options"),
    (COMPLETIONS, {"prompt": "x", "guided_choice": []}, "choice", "guided_choice"),
    (COMPLETIONS, {"prompt": "x", "guided_regex": "("}, "regex", "guided_regex"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "schema",
     "response_format"),
    (COMPLETIONS, {"prompt": [1] * 100_000}, "at most 4864 values", None),
    (COMPLETIONS, {"prompt": [1] * 10 + ["a"]}, "prompt must be", "prompt"),
    (COMPLETIONS, {"prompt": "x", "stop": ["a"] * 3000 + [",,,,"] * 2000}, "values", None),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"a1": 2}}, "logit_bias keys must be token ids", "logit_bias"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"-1": 2}}, "logit_bias keys must be token ids", "logit_bias"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias values must be in [-100, 100]",
     "logit_bias"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1000000": 1}}, "outside the vocabulary",
     "logit_bias"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": [1, 2]}, "logit_bias", "logit_bias"),
    (COMPLETIONS, {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2]",
     "presence_penalty"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": -3}, "frequency_penalty must be",
     "frequency_penalty"),
    (COMPLETIONS, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty must be a finite number above 0",
     "repetition_penalty"),
    (COMPLETIONS, {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids must be None or a non-empty list",
     "allowed_token_ids"),
    (COMPLETIONS, {"prompt": "x", "allowed_token_ids": [10**6]}, "outside the vocabulary", "allowed_token_ids"),
    (COMPLETIONS, {"prompt": "x", "bad_words": ["ok", "  "]}, "bad_words must be words", "bad_words"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "bad_words": "ok"}, "bad_words", "bad_words"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens must be an integer in 0..max_tokens",
     "min_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 1, "guided_regex": "a+"},
     "min_tokens cannot be combined with structured_outputs", "min_tokens"),
]


@pytest.mark.parametrize("route, body, words, param", BAD, ids=range(len(BAD)))
def test_each_bad_input_class_is_a_400_that_names_it(served, route, body, words, param):
    got = error(post(served, route, body))
    assert words in got["message"], got
    assert got["param"] == param, got


@pytest.mark.parametrize("field, value", [("response_format", {"type": "text"}), ("best_of", 1),
                                          ("repetition_penalty", 1.0), ("presence_penalty", 0.0),
                                          ("tool_choice", "none"), ("tools", []), ("logprobs", False),
                                          ("logprobs", None), ("top_logprobs", 0), ("echo", False),
                                          ("parallel_tool_calls", True), ("logit_bias", {}), ("store", False),
                                          ("service_tier", "auto"), ("modalities", ["text"]), ("min_tokens", 0),
                                          ("skip_special_tokens", True),
                                          ("metadata", {"team": "a"})])
def test_neutral_values_of_fields_not_implemented_are_accepted(served, field, value):
    response = post(served, COMPLETIONS, {"prompt": "x", "max_tokens": 2, field: value})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")


OPTIONAL = ["model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "n",
            "stream", "stream_options", "user", "metadata", "response_format", "structured_outputs", "guided_json",
            "guided_regex", "guided_choice", "guided_grammar", "logprobs", "min_tokens", "include_stop_str_in_output",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids",
            "bad_words", "prompt_logprobs"]


@pytest.mark.parametrize("route, own", [(COMPLETIONS, ["max_tokens", "echo"]),
                                        (CHAT, ["max_tokens", "max_completion_tokens", "top_logprobs",
                                                "add_generation_prompt", "continue_final_message",
                                                "chat_template_kwargs", "tools", "tool_choice",
                                                "parallel_tool_calls"])])
def test_null_is_the_default_of_every_optional_field(served, route, own):
    """The ``openai`` client sends ``null`` for an argument passed as ``None``: it means the field's default, as in
    OpenAI's API (it was a 400)."""
    first = {"prompt": "x"} if route == COMPLETIONS else {"messages": [{"role": "user", "content": "hi", "name": None}]}
    nulls = dict.fromkeys(OPTIONAL + own)
    got = post(served, route, {**first, "max_tokens": 3, "temperature": 0})
    response = post(served, route, {**first, **nulls, "max_tokens": 3, "temperature": 0})
    assert response.status_code == got.status_code == 200, response.text
    texts = [[c.get("text") or c["message"]["content"] for c in r.json()["choices"]] for r in (response, got)]
    assert texts[0] == texts[1]
    sampled = post(served, route, {**first, "temperature": None, "max_tokens": 2})
    assert sampled.json()["usage"]["completion_tokens"] >= 1
    assert error(post(served, route, {**first, "colour": None}))["param"] == "colour"  # unknown, even as null


def test_chat_defaults_max_tokens_to_what_the_context_leaves(served):
    response = post(served, CHAT, {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True,
                                   "temperature": 0})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["total_tokens"] == CONTEXT and response.json()["choices"][0]["finish_reason"] == "length"


KEYS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
        "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "n", "stream", "stream_options", "user",
        "logprobs", "top_logprobs", "best_of", "response_format", "echo", "tools", "tool_choice", "repetition_penalty",
        "presence_penalty", "frequency_penalty", "logit_bias", "allowed_token_ids", "bad_words", "prompt_logprobs",
        "input", "instructions", "max_output_tokens", "text", "previous_response_id", "reasoning", "include",
        "system", "stop_sequences", "thinking", "output_config",
        "k" + SURROGATE, "zz"]
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 4), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
    st.text(max_size=6), st.sampled_from([SURROGATE, "a\udcff", "tiny", "€🙂", "x" * 300, 10**30, 1e308]),
)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.sampled_from(["role", "content", "type",
                                                                                        "text", "a"]), inner,
                                                                       max_size=3)), max_leaves=8)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "bot", "tool", "assistant", 3]),
                                           "content": st.one_of(st.text(max_size=8), VALUES)},
                                          optional={"tool_calls": VALUES, "tool_call_id": VALUES}), max_size=3)
ITEMS = st.one_of(st.text(max_size=8), st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "developer", "assistant", "tool", 3]),
                           "content": st.one_of(st.text(max_size=8), VALUES)}, optional={"type": VALUES}),
    st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output", "reasoning",
                                                    "input_image", "message"])},
                          optional={"call_id": VALUES, "name": VALUES, "arguments": VALUES, "output": VALUES,
                                    "summary": VALUES, "content": VALUES}),
    VALUES), max_size=3))
BLOCKS = st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image"])},
                          optional={"text": VALUES, "id": VALUES, "name": VALUES, "input": VALUES,
                                    "tool_use_id": VALUES, "content": VALUES, "thinking": VALUES}),
    VALUES), max_size=3)
TURNS = st.lists(st.one_of(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", 3]),
                                                  "content": st.one_of(st.text(max_size=8), BLOCKS, VALUES)}),
                           VALUES), max_size=3)
BODIES = st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=6)


@st.composite
def requests(draw):
    body = draw(BODIES)
    route = draw(st.sampled_from([COMPLETIONS, CHAT, RESPONSES, ANTHROPIC]))
    if draw(st.booleans()):
        main = {COMPLETIONS: "prompt", CHAT: "messages", RESPONSES: "input", ANTHROPIC: "messages"}[route]
        body[main] = draw({COMPLETIONS: st.one_of(st.text(max_size=10), st.lists(st.integers(-2, 200), max_size=5)),
                           CHAT: MESSAGES, RESPONSES: ITEMS, ANTHROPIC: TURNS}[route])
    if draw(st.booleans()):  # keep what generates short
        body["max_output_tokens" if route == RESPONSES else "max_tokens"] = draw(st.integers(-1, 3))
    raw = json.dumps(body, allow_nan=True)
    mangle = draw(st.sampled_from(["", "", "", "truncate", "nest", "utf16", "bigint"]))
    if mangle == "truncate":
        raw = raw[: draw(st.integers(0, len(raw)))]
    elif mangle == "nest":
        raw = "[" * draw(st.integers(60, 3000)) + raw
    elif mangle == "utf16":
        return route, raw.encode("utf-16-le")
    elif mangle == "bigint":
        raw = raw[:-1] + (", " if len(raw) > 2 else "") + '"seed": ' + "7" * 5000 + "}"
    return route, raw.encode()


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(case=requests())
def test_fuzzed_requests_never_get_a_500(served, case, caplog):
    route, body = case
    with caplog.at_level("ERROR"):
        response = post(served, route, body)
    assert response.status_code in (200, 400, 404, 413, 429), (response.status_code, response.text[:300])
    if response.status_code != 200 and route == ANTHROPIC:
        body = response.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    elif response.status_code != 200:
        error(response, response.status_code)
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
