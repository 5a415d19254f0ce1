"""Structured output in the API and the server: every output is valid against its constraint (200 generated
schemas, plain and speculative), bad constraints are clear errors, limits end with ``"length"``, compilation
is cached and timed, and the real ``openai`` client's ``response_format`` works against ``specdec serve``."""

import json
import random
import sys

import httpx
import jsonschema
import llguidance
import llguidance.hf
import openai
import pytest
from test_server import TEMPLATE, Served

from specdec import LLM, SamplingParams, SpecDecError, StructuredOutputsParams
from specdec.server import create_app

NUM_SCHEMAS = 200
MAX_TOKENS = 40
PROMPTS = ["def f(x):\n", "for i in range(10):\n    print(", "x = 1\n", '{"a": 1}', "return"]


def random_value_schema(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(["integer", "enum", "boolean", "string", "array", "object"] if depth < 1 else
                      ["integer", "enum", "boolean", "string"])
    if kind == "integer":
        low = rng.randint(-20, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 200)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "x", "yes", "no", "def"], rng.randint(1, 3))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 4)}
    if kind == "array":
        return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "maxItems": rng.randint(0, 3)}
    return random_object_schema(rng, depth + 1)


def random_object_schema(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(["a", "b", "id", "name", "ok", "n", "tag"], rng.randint(1, 3))
    return {"type": "object", "properties": {n: random_value_schema(rng, depth) for n in names},
            "required": names, "additionalProperties": False}


@pytest.fixture(scope="module")
def lltokenizer(text_model_dirs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(text_model_dirs["target"])
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))


def is_valid_prefix(lltokenizer, schema: dict, compact: bool, tokens: list[int]) -> bool:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": not compact})
    matcher = llguidance.LLMatcher(lltokenizer, grammar)
    return matcher.try_consume_tokens(tokens) == len(tokens) and not matcher.is_error()


@pytest.mark.parametrize("kind", ["plain", "draft_model", "ngram"])
def test_every_output_is_valid_over_200_schemas(text_model_dirs, lltokenizer, kind):
    rng = random.Random(2026)
    schemas = [random_object_schema(rng) for _ in range(NUM_SCHEMAS)]
    compact = [i % 5 != 0 for i in range(NUM_SCHEMAS)]  # every fifth allows any whitespace
    params = [SamplingParams(temperature=[0.0, 0.8, 1.0][i % 3], seed=i, max_tokens=MAX_TOKENS,
                             structured_outputs=StructuredOutputsParams(json=s, disable_any_whitespace=c))
              for i, (s, c) in enumerate(zip(schemas, compact))]
    spec = {"draft_model": {"method": "draft_model", "model": str(text_model_dirs["draft"]),
                            "num_speculative_tokens": 3},
            "ngram": {"method": "ngram", "num_speculative_tokens": 3}, "plain": None}[kind]
    llm = LLM(text_model_dirs["target"], dtype="float64", max_num_seqs=16, speculative_config=spec)
    outputs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(NUM_SCHEMAS)], params)
    finished = 0
    for schema, c, out in zip(schemas, compact, outputs):
        completion = out.outputs[0]
        if completion.finish_reason == "stop":
            jsonschema.validate(json.loads(completion.text), schema)
            finished += 1
        else:
            assert completion.finish_reason == "length" and len(completion.token_ids) == MAX_TOKENS
            assert is_valid_prefix(lltokenizer, schema, c, completion.token_ids), completion.text
    assert finished >= NUM_SCHEMAS // 2, f"only {finished} of {NUM_SCHEMAS} outputs finished: the test checks little"
    assert llm.batch_metrics.num_grammar_compiles == len({json.dumps(s) + str(c)
                                                          for s, c in zip(schemas, compact)})


@pytest.fixture(scope="module")
def llm(text_model_dirs):
    spec = {"method": "draft_model", "model": str(text_model_dirs["draft"]), "num_speculative_tokens": 3}
    return LLM(text_model_dirs["target"], dtype="float64", max_num_seqs=4, speculative_config=spec)


def test_regex_choice_and_grammar_outputs_match(llm):
    cases = [(StructuredOutputsParams(regex=r"[a-z]{2,5}-[0-9]{2}"), r"[a-z]{2,5}-[0-9]{2}"),
             (StructuredOutputsParams(choice=["return x", "print(i)"]), None),
             (StructuredOutputsParams(grammar='root ::= "f(" [0-9] ("," [0-9])* ")"'), r"f\([0-9](,[0-9])*\)")]
    import re

    for seed in range(4):
        for constraint, pattern in cases:
            params = SamplingParams(temperature=1.0, seed=seed, max_tokens=24, structured_outputs=constraint)
            out = llm.generate("def f(x):", params)[0].outputs[0]
            assert out.finish_reason == "stop", out
            if pattern is None:
                assert out.text in constraint.choice
            else:
                assert re.fullmatch(pattern, out.text), out.text


def test_sampling_parameters_past_float32s_range_meet_the_constraint(text_model_dirs):
    """In float32, a temperature of 1e300 under a constraint samples one of its texts, and a top_p of 1e-300 gives
    greedy decoding's text; both were a grammar failure (a server's 500) or an empty text."""
    llm = LLM(text_model_dirs["target"], dtype="float32", max_num_seqs=2)
    choices = ["return x", "print(i)"]
    hot = SamplingParams(temperature=1e300, seed=0, max_tokens=12, structured_outputs={"choice": choices})
    assert llm.generate("def f(x):", hot)[0].outputs[0].text in choices
    greedy = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    narrow = llm.generate("def f(x):", SamplingParams(temperature=0.5, top_p=1e-300, seed=1, max_tokens=8))[0]
    assert narrow.outputs[0].token_ids == greedy.token_ids and greedy.text


def test_a_constraint_that_cannot_finish_ends_with_length(llm):
    params = SamplingParams(temperature=0, max_tokens=3, structured_outputs={"choice": ["print(i)"]})
    out = llm.generate("x", params)[0].outputs[0]
    assert out.finish_reason == "length" and out.text == "pri"


def test_compilation_is_cached_and_timed(text_model_dirs):
    llm = LLM(text_model_dirs["target"], dtype="float64")
    schema = {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]}
    same = json.dumps(schema, indent=2)  # the same schema as JSON text
    first = llm.generate("x", SamplingParams(max_tokens=8, structured_outputs={"json": schema}))[0]
    second = llm.generate("x", SamplingParams(max_tokens=8, structured_outputs={"json": same}))[0]
    assert first.metrics.time_grammar_compile > 0 and second.metrics.time_grammar_compile == 0
    assert llm.batch_metrics.num_grammar_compiles == 1
    assert llm.batch_metrics.time_grammar_compile == first.metrics.time_grammar_compile
    assert StructuredOutputsParams(json=schema) == StructuredOutputsParams(json=same)


@pytest.mark.parametrize("fields,words", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": [1, 2]}, "JSON schema"),
    ({"choice": []}, "non-empty list"),
    ({"regex": 5}, "non-empty string"),
    ({"json_object": "yes"}, "True or False"),
])
def test_malformed_constraints_are_refused(fields, words):
    with pytest.raises(SpecDecError, match=words):
        StructuredOutputsParams(**fields)


def test_unknown_constraint_keys_are_named():
    with pytest.raises(SpecDecError, match="jsn"):
        SamplingParams(structured_outputs={"jsn": {}})


@pytest.mark.parametrize("constraint,words", [
    ({"regex": "a(b"}, "invalid regex.*unclosed group"),
    ({"json": {"type": "foo"}}, "invalid JSON schema.*foo"),
    ({"json": {"not": {"type": "string"}}}, "invalid JSON schema.*Unimplemented keys.*not"),
    ({"json": {"type": "string", "format": "hostname2"}}, "invalid JSON schema.*hostname2"),
    ({"grammar": "root ::= missing"}, "invalid grammar.*missing"),
])
def test_invalid_constraints_are_clear_errors(llm, constraint, words):
    with pytest.raises(SpecDecError, match=words):
        llm.generate("x", SamplingParams(structured_outputs=constraint))


def test_missing_llguidance_says_how_to_install_it(text_model_dirs, monkeypatch):
    fresh = LLM(text_model_dirs["target"], dtype="float64")
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(SpecDecError, match=r'pip install "specdec\[structured\]"'):
        fresh.generate("x", SamplingParams(structured_outputs={"regex": "a+"}))


def test_a_model_without_a_tokenizer_is_a_clear_error(model_dirs):
    bare = LLM(model_dirs["llama"]["target"], dtype="float64")
    with pytest.raises(SpecDecError, match="tokenizer"):
        bare.generate({"prompt_token_ids": [1, 2]}, SamplingParams(structured_outputs={"regex": "a+"}))


# ---------------------------------------------------------------------------------------------- the server
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(llm):
    served = Served(create_app(llm, served_model_name="tiny", api_key="", chat_template=TEMPLATE))
    yield served
    served.stop()


def test_openai_client_response_format(server):
    client = server.client()
    for seed in range(3):
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Who?"}], max_tokens=48, seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
        choice = chat.choices[0]
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        else:
            assert choice.finish_reason == "length"
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=64,
                                          temperature=0, response_format={"type": "json_object"})
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(chat.choices[0].message.content), dict)
    else:
        assert chat.choices[0].message.content.startswith("{")
    # Streaming, on the completions endpoint through vLLM's request fields.
    stream = client.completions.create(model="tiny", prompt="def", max_tokens=16, stream=True,
                                       extra_body={"guided_choice": ["alpha", "beta", "gamma"]})
    assert "".join(chunk.choices[0].text for chunk in stream) in ("alpha", "beta", "gamma")
    done = client.completions.create(model="tiny", prompt="def", max_tokens=16,
                                     extra_body={"guided_regex": "[0-9]{3}"})
    assert done.choices[0].text.isdigit() and len(done.choices[0].text) == 3
    done = client.completions.create(model="tiny", prompt="def", max_tokens=16,
                                     extra_body={"structured_outputs": {"grammar": 'root ::= "ok" [!?]'}})
    assert done.choices[0].text in ("ok!", "ok?")


def test_text_response_format_is_no_constraint(server):
    client = server.client()
    kwargs = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "temperature": 0}
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    text = client.chat.completions.create(**kwargs, response_format={"type": "text"}).choices[0].message.content
    assert text == plain


def error_of(call) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    body = info.value.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_bad_constraints_are_400(server):
    create = server.client().completions.create
    error = error_of(lambda: create(model="tiny", prompt="x", extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}))
    assert "invalid JSON schema" in error["message"]
    error = error_of(lambda: create(model="tiny", prompt="x", extra_body={"guided_regex": "a(b"}))
    assert "invalid regex" in error["message"]
    error = error_of(lambda: create(model="tiny", prompt="x", extra_body={"guided_regex": "a", "guided_choice": ["b"]}))
    assert "one structured-output constraint" in error["message"]
    error = error_of(lambda: create(model="tiny", prompt="x", extra_body={"response_format": {"type": "json_schema"}}))
    assert "json_schema.schema" in error["message"]
    error = error_of(lambda: create(model="tiny", prompt="x", extra_body={"response_format": {"type": "yaml"}}))
    assert "response_format" in error["param"]


def test_structured_outputs_options_apply_to_another_fields_constraint(server, llm):
    """As vLLM merges them: ``structured_outputs`` with options only (``disable_any_whitespace``) applies them to the
    constraint of ``response_format`` or a ``guided_*`` field; options alone, or bad ones, are a 400 naming it."""
    create = server.client().completions.create
    kwargs = {"model": "tiny", "prompt": "x", "max_tokens": 24, "temperature": 0}
    compact = create(**kwargs, extra_body={"response_format": {"type": "json_object"},
                                           "structured_outputs": {"disable_any_whitespace": True}}).choices[0].text
    spaced = create(**kwargs, extra_body={"response_format": {"type": "json_object"}}).choices[0].text
    expected = [llm.generate("x", SamplingParams(temperature=0, max_tokens=24, structured_outputs={
        "json_object": True, "disable_any_whitespace": flag}))[0].outputs[0].text for flag in (True, False)]
    assert [compact, spaced] == expected and expected[0] != expected[1]
    choice = create(**kwargs, extra_body={"guided_choice": ["a b", "c"],
                                          "structured_outputs": {"disable_any_whitespace": False}}).choices[0].text
    assert choice in ("a b", "c")
    error = error_of(lambda: create(**kwargs, extra_body={"structured_outputs": {"disable_any_whitespace": True}}))
    assert "takes exactly one of" in error["message"] and error["param"] == "structured_outputs"
    error = error_of(lambda: create(**kwargs, extra_body={"guided_regex": "a+",
                                                          "structured_outputs": {"disable_any_whitespace": 1}}))
    assert "disable_any_whitespace" in error["message"] and error["param"] == "structured_outputs"


def test_metrics_report_grammar_compilation(server):
    server.client().completions.create(model="tiny", prompt="x", max_tokens=4,
                                       extra_body={"guided_regex": "[a-c]{1,9}q"})
    text = httpx.get(server.root + "/metrics").text
    assert "specdec:grammar_compiles_total" in text and "specdec:grammar_compile_seconds_total" in text
    assert server.value("specdec:grammar_compiles_total") >= 1
    assert server.value("specdec:grammar_compile_seconds_total") > 0


def test_a_seeded_constrained_request_is_the_same_alone_or_in_a_batch(llm):
    mine = SamplingParams(temperature=1.0, seed=11, max_tokens=24, structured_outputs={"json_object": True})
    others = [SamplingParams(temperature=0.9, seed=s, max_tokens=24, structured_outputs=c)
              for s, c in ((1, {"regex": "[a-z]+"}), (2, None), (3, {"choice": ["a", "bb"]}))]
    alone = llm.generate("x = 1\n", mine)[0].outputs[0].token_ids
    batch = llm.generate(["def", "x = 1\n", "for", "y"], [others[0], mine, others[1], others[2]])
    assert batch[1].outputs[0].token_ids == alone


def test_an_unconstrained_batch_does_no_constraint_work():
    import torch

    from specdec.sampling import SamplingBatch

    rows = SamplingBatch([SamplingParams(), SamplingParams(temperature=0)], [None, None], torch.device("cpu"),
                         [None, None])
    logits = torch.randn(2, 8)
    assert rows.grammars is None and not rows.constrained and rows.constrain_draft(logits) is logits
