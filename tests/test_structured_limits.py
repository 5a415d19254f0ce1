"""Constraints past llguidance's limits are clear errors at submit, never an empty ``"stop"`` output nor a Rust
backtrace: a regex too large for its lexer, a constraint that matches no text, a choice with too many entries, a
schema nested too deeply; a grammar failure that still happens mid-generation is an error the caller sees."""

import json

import httpx
import pytest
from test_server import TEMPLATE, Served

from specdec import LLM, SamplingParams, SpecDecError, StructuredOutputsParams
from specdec.server import create_app
from specdec.structured.grammar import clean_message, compile_error
from specdec.structured.params import MAX_CHOICES, MAX_SCHEMA_DEPTH
from specdec.structured.state import GrammarEngineError

HUGE_REGEX = "a{1000000}"  # its lexer passes llguidance's limits at the first token
LATE_HUGE_REGEX = "[a-z]{6}a{1000000}"  # ... and here only after six tokens: past the compile-time probe
NO_TEXT_REGEX = "[^\\x00-\\U0010FFFF]"


@pytest.fixture(scope="module")
def llm(text_model_dirs):
    return LLM(text_model_dirs["target"], dtype="float64", max_num_seqs=4)


@pytest.fixture(scope="module")
def spec_llm(text_model_dirs):
    spec = {"method": "draft_model", "model": str(text_model_dirs["draft"]), "num_speculative_tokens": 3}
    return LLM(text_model_dirs["target"], dtype="float64", max_num_seqs=4, speculative_config=spec)


def constrained(constraint: dict, max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, structured_outputs=constraint)


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema  # ``depth`` dicts, one inside the other


def assert_clean(message: str) -> None:
    for leftover in ("<state>", "<backtrace>", "<non-verbose/>", "panic", " at /", "\n"):
        assert leftover not in message, message


# ----------------------------------------------------------------------------------- a regex too large
@pytest.mark.parametrize("which", ["llm", "spec_llm"])
def test_a_regex_too_large_for_the_engine_is_refused_at_submit(request, which):
    engine = request.getfixturevalue(which)
    for prompt in ("a", "another prompt"):  # and again: a refused grammar is not cached
        with pytest.raises(SpecDecError, match="regex in structured_outputs is too large for the grammar engine"
                                               ".*too many expressions") as info:
            engine.generate(prompt, constrained({"regex": HUGE_REGEX}))
        assert_clean(str(info.value))
    out = engine.generate("a", constrained({"regex": "[0-9]{2}"}))[0].outputs[0]  # the engine is fine
    assert out.text.isdigit() and len(out.text) == 2 and out.finish_reason == "stop"


@pytest.mark.parametrize("which", ["llm", "spec_llm"])
def test_a_grammar_failure_mid_generation_is_an_error_never_an_empty_stop(request, which):
    engine = request.getfixturevalue(which)
    compiles = engine.batch_metrics.num_grammar_compiles
    for _ in range(2):  # the second request's copy of the cached grammar would fail at its first mask
        with pytest.raises(GrammarEngineError, match="grammar engine failed.*too many expressions") as info:
            engine.generate("a", constrained({"regex": LATE_HUGE_REGEX}, max_tokens=12))
        assert_clean(str(info.value))
    # The grammar a request drove past the engine's limits is compiled anew for the next request.
    assert engine.batch_metrics.num_grammar_compiles == compiles + 2
    out = engine.generate("a", constrained({"regex": "[a-c]{3}"}))[0].outputs[0]
    assert len(out.text) == 3 and set(out.text) <= set("abc") and out.finish_reason == "stop"


@pytest.mark.parametrize("which", ["llm", "spec_llm"])
def test_a_grammar_failure_mid_generation_fails_its_request_only(request, which):
    engine = request.getfixturevalue(which)
    broken = engine.stream("a", constrained({"regex": LATE_HUGE_REGEX}, max_tokens=12))
    fine = engine.stream("b", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    texts = []
    with pytest.raises(GrammarEngineError, match="grammar engine failed"):
        for _ in broken:  # both run in the same steps
            texts.append(next(fine).text)
    rest = list(fine)  # the other request goes on to its end
    assert rest[-1].finished and rest[-1].finish_reason == "length"
    assert "".join(texts + [o.text for o in rest]) == engine.generate(
        "b", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].outputs[0].text
    assert not engine.scheduler.has_work


# ------------------------------------------------------------------------------- matching no text
@pytest.mark.parametrize("constraint,words", [
    ({"regex": NO_TEXT_REGEX}, "the regex in structured_outputs matches no text"),
    ({"grammar": 'start: /[^\\x00-\\x{10FFFF}]/ "x"'}, "the grammar in structured_outputs matches no text"),
    ({"json": False}, "'json' is the schema false, which matches no text"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 3}}, "invalid JSON schema.*Unsatisfiable"),
])
def test_a_constraint_that_matches_no_text_is_refused_at_submit(llm, spec_llm, constraint, words):
    for engine in (llm, spec_llm):
        with pytest.raises(SpecDecError, match=words):
            engine.generate("a", constrained(constraint))


def test_a_constraint_that_accepts_the_empty_text_may_stop_at_once(llm, spec_llm):
    for engine in (llm, spec_llm):
        out = engine.generate("a", constrained({"regex": "a{0}"}))[0].outputs[0]
        assert (out.text, out.finish_reason) == ("", "stop")
        out = engine.generate("a", SamplingParams(max_tokens=6, temperature=1.0, seed=3,
                                                  structured_outputs={"regex": "(abc)?"}))[0].outputs[0]
        assert out.text in ("", "abc") and out.finish_reason == "stop"


def test_the_schema_true_is_any_json_value(llm):
    assert StructuredOutputsParams(json=True) == StructuredOutputsParams(json={})
    out = llm.generate("a", SamplingParams(max_tokens=24, temperature=1.0, seed=1,
                                           structured_outputs={"json": True}))[0].outputs[0]
    if out.finish_reason == "stop":
        json.loads(out.text)
    else:
        assert out.finish_reason == "length"


# ---------------------------------------------------------------------------------- too many choices
def test_a_choice_with_too_many_entries_is_refused_before_compiling(llm):
    with pytest.raises(SpecDecError, match=f"'choice' has 100000 entries; at most {MAX_CHOICES}"):
        llm.generate("a", constrained({"choice": [f"c{i}" for i in range(100_000)]}))
    with pytest.raises(SpecDecError, match=f"has {MAX_CHOICES + 1} entries"):
        StructuredOutputsParams(choice=[f"c{i}" for i in range(MAX_CHOICES + 1)])
    assert len(StructuredOutputsParams(choice=[f"c{i}" for i in range(MAX_CHOICES)]).choice) == MAX_CHOICES


def test_engine_messages_lose_backtraces_state_dumps_and_panics():
    panic = ("panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n<backtrace>\n   0: <unknown>\n"
             "  16: type_call\n             at /tmp/python-build.1/Python-3.11.7/Objects/typeobject.c:1:1\n"
             "</backtrace>")
    error = compile_error("grammar", panic)
    assert str(error) == ("the grammar in structured_outputs is too large for the grammar engine: too many grammar "
                          "symbols (llguidance allows about 65,000)")
    assert clean_message("lexer error: too many expressions constructed\n<state>\nTokens: ⟦a⟧\n") == \
        "lexer error: too many expressions constructed"
    assert clean_message("regex parse error:\n    <a(b\n      ^\nerror: unclosed group") == \
        "regex parse error: <a(b ^ error: unclosed group"  # a line of the regex itself is kept
    assert len(clean_message("x" * 100_000)) == 400
    assert str(compile_error("regex", "regex parse error:\n    limit(\n         ^\nerror: unclosed group")) == \
        "invalid regex in structured_outputs: regex parse error: limit( ^ error: unclosed group"
    assert str(compile_error("grammar", "panic: index out of bounds\n<backtrace>\n  0: x\n</backtrace>")) == \
        "the grammar engine failed on the grammar in structured_outputs: index out of bounds"


# ----------------------------------------------------------------------------------- deep schemas
def test_a_schema_nested_too_deeply_is_refused_up_front(llm):
    deep = nested(3000)
    with pytest.raises(SpecDecError, match=f"'json' is nested more than {MAX_SCHEMA_DEPTH} levels deep"):
        llm.generate("a", constrained({"json": deep}))
    for schema in (deep, nested(MAX_SCHEMA_DEPTH + 1)):
        with pytest.raises(SpecDecError, match="nested more than"):
            StructuredOutputsParams(json=schema)
    text = '{"type":"array","items":' * 3000 + '{"type":"integer"}' + "}" * 3000  # as JSON text too
    with pytest.raises(SpecDecError, match="nested more than"):
        StructuredOutputsParams(json=text)
    assert StructuredOutputsParams(json=nested(MAX_SCHEMA_DEPTH)).key[0] == "json"


# -------------------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server(llm):
    served = Served(create_app(llm, served_model_name="tiny", api_key="", chat_template=TEMPLATE))
    yield served
    served.stop()


def post(server, **fields) -> httpx.Response:
    return httpx.post(server.root + "/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": "a", "max_tokens": 4, "temperature": 0, **fields})


@pytest.mark.parametrize("fields,words", [
    ({"guided_regex": "b{1000000}"}, "too large for the grammar engine"),
    ({"guided_regex": NO_TEXT_REGEX}, "matches no text"),
    ({"guided_choice": [f"c{i}" for i in range(MAX_CHOICES + 1)]}, f"has {MAX_CHOICES + 1} entries; at most"),
])  # (a schema nested too deeply is refused by the server's own limit on the body's depth first)
def test_the_server_answers_400_with_a_clean_message(server, fields, words):
    reply = post(server, **fields)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"
    assert_clean(error["message"])
    ok = post(server, guided_regex="[0-9]{2}")
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["text"]) == 2


def test_the_server_fails_a_mid_generation_grammar_failure_instead_of_a_200(server):
    for _ in range(2):  # the second was a 200 with "" and "stop"
        reply = post(server, guided_regex=LATE_HUGE_REGEX, max_tokens=12)
        assert reply.status_code == 500 and "grammar engine failed" in reply.json()["error"]["message"], reply.text
    ok = post(server, guided_regex="[0-9]{2}")
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["text"]) == 2
