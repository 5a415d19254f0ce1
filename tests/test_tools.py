"""Tool calling (``specdec.tools``, ``specdec.server.tool_calls``): tools offered by the chat template, earlier calls
and their results in the conversation, ``tool_choice`` none / auto (the hermes parser) / required / a function,
whole and streamed, through the ``openai`` client's agent loop; a forced call under speculation equals plain
decoding's; every bad tool, choice or message is a 400 naming its field (a :class:`SpecDecError` offline)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_server import PLAIN, SPEC, Served, draft_dir, make_llm  # noqa: F401

from specdec import SamplingParams, SpecDecError
from specdec.call_list import CallReader
from specdec.server import create_app
from specdec.server.tool_calls import ToolOutput
from specdec.structured import StructuredOutputsParams
from specdec.tools import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    PythonicParser,
    ToolCall,
    check_tool_choice,
    check_tools,
    required_calls,
    schema,
)

TEMPLATE = ("{% if tools %}<tools> {{ tools | map(attribute='function') | map(attribute='name') | join(',') }}\n"
            "{% endif %}{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}"
            "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments.city }}]{% endfor %}"
            "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant> {% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Paris", "Oslo", "Lima"]}},
                                                "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "weather?"}]
FORCED = {"type": "function", "function": {"name": "get_weather"}}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}  # a random model's JSON would be all blanks
HERMES = 'Sure\\. <tool_call>\\{"name":"get_time","arguments":\\{"zone":"UTC"\\}\\}</tool_call>'  # a regex


def hermes_app(text_model_dirs, draft_dir):  # noqa: F811
    """The tiny model served with draft_model speculation, ``TEMPLATE`` and the hermes parser for ``"auto"``."""
    return create_app(make_llm(text_model_dirs, draft_dir, SPEC), served_model_name="tiny", api_key="",
                      chat_template=TEMPLATE, enable_auto_tool_choice=True, tool_call_parser="hermes")


@pytest.fixture(scope="module")
def server(text_model_dirs, draft_dir):  # noqa: F811
    served = Served(hermes_app(text_model_dirs, draft_dir))
    yield served
    served.stop()


@pytest.fixture(scope="module")
def plain(text_model_dirs, draft_dir):  # noqa: F811
    return make_llm(text_model_dirs, draft_dir, PLAIN)


def post(server, body: dict, root: str | None = None) -> httpx.Response:
    return httpx.post(f"{root or server.root}/v1/chat/completions", json={"model": "tiny", **body}, timeout=60)


def stream(server, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.root}/v1/chat/completions",
                      json={"model": "tiny", "stream": True, **body}, timeout=60) as response:
        assert response.status_code == 200
        return [json.loads(line[6:]) for line in response.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


REQUIRED_TWO = ('[{"name": "get_weather", "parameters": {"city": "O\\"s]}lo", "days": [1, {"n": 2}]}},\n'
                '  {"name":"get_time","parameters":{ "zone" : "UTC" }}]')


HERMES_TWO = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
              '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>'
              '<tool_call>{"name": "now"}</tool_call>')
MISTRAL_TWO = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS] {"zone": "UTC"} '


def joined_calls(events: list[dict], index: int = 0) -> tuple[str, list[dict], str | None]:
    """A streamed choice's content, its calls assembled from the deltas (as OpenAI's client does) and its finish."""
    content, calls, finish = "", {}, None
    for event in events:
        for choice in event["choices"]:
            if choice["index"] != index:
                continue
            content += choice["delta"].get("content") or ""
            for delta in choice["delta"].get("tool_calls") or ():
                call = calls.setdefault(delta["index"], {"id": None, "name": None, "arguments": ""})
                call["id"] = delta.get("id") or call["id"]
                call["name"] = delta.get("function", {}).get("name") or call["name"]
                call["arguments"] += delta.get("function", {}).get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


# ---------------------------------------------------------------------------------------------- the pure parts
def test_tools_and_choices_are_checked():
    assert check_tools(None) is None and check_tools([]) is None and check_tools(TOOLS) == TOOLS
    for tools, words in [({"a": 1}, "must be a list"), ([{"type": "function"}], r"tools\[0\] must be"),
                         ([{"type": "code_interpreter", "function": {"name": "f"}}], r"tools\[0\] must be"),
                         ([{"type": "function", "function": {"name": "a b"}}], "letters, digits"),
                         ([{"type": "function", "function": {"name": "x" * 65}}], "1 to 64"),
                         ([WEATHER, WEATHER], "given twice"),
                         ([{"type": "function", "function": {"name": "f", "parameters": []}}], "JSON schema"),
                         ([{"type": "function", "function": {"name": "f", "description": 3}}], "description")]:
        with pytest.raises(SpecDecError, match=words):
            check_tools(tools)
    assert check_tool_choice(None, None) == "none" and check_tool_choice(None, TOOLS) == "auto"
    assert check_tool_choice("required", TOOLS) == "required" and check_tool_choice(FORCED, TOOLS) == "get_weather"
    for choice, tools, words in [("sometimes", TOOLS, "must be one of"), ("required", None, "no tools are given"),
                                 ({"type": "function", "function": {"name": "nope"}}, TOOLS, "not in tools"),
                                 ({"type": "function"}, TOOLS, "must be one of")]:
        with pytest.raises(SpecDecError, match=words):
            check_tool_choice(choice, tools)


def test_schemas_of_the_choices():
    assert schema("none", TOOLS) is None and schema("auto", TOOLS) is None
    assert schema("get_time", TOOLS) == TIME["function"]["parameters"]
    assert schema("f", [{"type": "function", "function": {"name": "f"}}]) == {"type": "object"}
    calls = schema("required", TOOLS)
    jsonschema.validate([{"name": "get_time", "parameters": {"zone": "UTC"}},
                         {"name": "get_weather", "parameters": {"city": "Lima"}}], calls)
    for wrong in ([], [{"name": "get_time", "parameters": {"city": "Lima"}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, calls)
    single = schema("required", TOOLS, parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {"zone": "UTC"}}] * 2, single)


def test_the_hermes_parser():
    parser = HermesParser()
    text = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
    content, calls = parser.parse(text)
    assert content == "Let me look. " and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "UTC"})]
    assert parser.parse('<tool_call>{"name": "f", "arguments": {}}')[0] is None  # unclosed at the end: still a call
    assert parser.parse("no calls")[1] == [] and parser.parse("<tool_call>{not json}</tool_call>") == (
        "<tool_call>{not json}</tool_call>", [])
    assert parser.parse('<tool_call>["f"]</tool_call>')[1] == []
    assert [parser.content_end(t) for t in ("abc", "abc <tool", "abc <tool_call>{", "<", "a<b")] == [3, 4, 4, 0, 3]
    assert required_calls('[{"name": "f", "parameters": {"a": 1}}]')[0].arguments == '{"a": 1}'
    assert required_calls('[{"name": "f", "parameters"') is None and required_calls("[]") is None
    assert ToolCall("f", "{}").id.startswith("call_") and ToolCall("f", "{}").id != ToolCall("f", "{}").id


def test_the_llama3_json_parser():
    parser = Llama3JsonParser()
    one = parser.parse('{"name": "get_time", "parameters": {"zone": "UTC"}}')
    assert one[0] is None and [(c.name, c.arguments) for c in one[1]] == [("get_time", '{"zone": "UTC"}')]
    two = parser.parse('<|python_tag|>{"name": "f", "arguments": {}}; {"name": "g", "parameters": {"a": [1]}}')
    assert [(c.name, json.loads(c.arguments)) for c in two[1]] == [("f", {}), ("g", {"a": [1]})]
    for text in ("It is sunny.", '{"name": "f"} and more', '{"city": "Oslo"}', '{"name": "f", "parameters"'):
        assert parser.parse(text) == (text, [])
    assert [parser.content_end(t) for t in ("", "  {", "<|py", "<|python_tag|>{", "Hi", " Hi {")] == [0, 0, 0, 0, 2, 5]


def test_the_pythonic_parser():
    parser = PythonicParser()
    content, calls = parser.parse('[get_weather(city="Oslo", days=[1, 2], exact=True), get_time()]')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": [1, 2], "exact": True}), ("get_time", {})]
    assert parser.parse('<|python_start|>[f(a=None)]<|python_end|>')[1][0].arguments == '{"a": null}'
    for text in ("It is sunny.", "[1, 2]", "[f(1)]", "[f(a=x)]", "[f(**k)]", "[f(a=1)", "[a.b(c=1)]",
                 "[f(a=float('nan'))]"):
        assert parser.parse(text) == (text, [])
    assert [parser.content_end(t) for t in ("", " [f(", "<|py", "Hi", "Hi [")] == [0, 0, 0, 2, 4]
    assert parser.content_end("[f(", 3) == 3


MISTRAL_ID = re.compile("[A-Za-z0-9]{9}")


def test_the_mistral_parser():
    parser = MistralParser()
    content, calls = parser.parse('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                                  '{"name": "get_time", "arguments": {"zone": "UTC"}}]')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "UTC"})]
    assert all(MISTRAL_ID.fullmatch(c.id) for c in calls) and calls[0].id != calls[1].id
    content, calls = parser.parse('Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time'
                                  '[ARGS]{}')
    assert content == "Let me check." and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    for text in ("It is sunny.", "[TOOL_CALLS]", "[TOOL_CALLS]{broken", "[TOOL_CALLS]bad name[ARGS]{}",
                 "[TOOL_CALLS]f[ARGS]{", "[TOOL_CALLS][]", '[TOOL_CALLS][{"city": "Oslo"}]'):
        assert parser.parse(text) == (text, [])
    assert [parser.content_end(t) for t in ("", "Hi", "Hi [TOOL", "Hi [TOOL_CALLS][{")] == [0, 2, 3, 3]


def test_every_call_has_the_parsers_id_form():
    """Mistral's templates refuse ids that are not nine letters and digits: with its parser, forced and required
    calls get such ids too."""
    forced = ToolOutput("get_weather", MistralParser(), True).message('{"city": "Lima"}', "stop")
    required = ToolOutput("required", MistralParser(), True).message('[{"name": "f", "parameters": {}}]', "stop")
    for message in (forced, required):
        assert MISTRAL_ID.fullmatch(message["message"]["tool_calls"][0]["id"]), message
    assert ToolOutput("get_weather", HermesParser(), True).message("{}", "stop")["message"]["tool_calls"][0][
        "id"].startswith("call_")


@pytest.mark.parametrize("parser", [HermesParser, Llama3JsonParser, PythonicParser, MistralParser])
@pytest.mark.parametrize("choice, text", [
    ("auto", '{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", "parameters": {}}'),
    ("auto", '[get_time(zone="UTC"), get_weather(city="Oslo")]'),
    ("auto", 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'),
    ("auto", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'),
    ("auto", '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}'),
    ("auto", "just text <tool"), ("auto", "text <tool_call>{broken</tool_call>"), ("none", "a <tool_call>{}"),
    ("required", '[{"name": "get_time", "parameters": {"zone": "UTC"}}]'), ("required", '[{"name": '),
    ("required", REQUIRED_TWO), ("required", '[ {"parameters": {"name": "x"} , "name" : "f"} ]'),
    ("auto", HERMES_TWO), ("auto", MISTRAL_TWO), ("auto", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": [1]}},'
                                                          ' {"name": "g", "arguments": "{\\"b\\": 2}"}]'),
    ("get_weather", '{"city": "Lima"}')])
def test_streamed_deltas_add_up_to_the_whole_message(parser, choice, text):
    """Fed in pieces of every size, a stream's content and calls equal the whole response's message."""
    whole = ToolOutput(choice, parser(), True).message(text, "stop")
    for size in (1, 3, 100):
        output = ToolOutput(choice, parser(), True)
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        events = [{"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
                  for delta, finish in (output.delta(p, "stop" if i == len(pieces) - 1 else None)
                                        for i, p in enumerate(pieces))]
        content, calls, finish = joined_calls(events)
        assert content == (whole["message"]["content"] or "") and finish == whole["finish_reason"]
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in whole["message"].get("tool_calls", ())]
        assert all(c["id"] for c in calls)


def streamed(output: ToolOutput, text: str, finish: str = "stop") -> list[tuple[int, dict, str | None]]:
    """``(characters fed, delta, finish reason)`` of ``text`` fed to ``output`` one character at a time."""
    return [(i + 1, *output.delta(char, finish if i == len(text) - 1 else None)) for i, char in enumerate(text)]


def first_deltas(events: list[tuple[int, dict, str | None]]) -> list[tuple[int, int, str]]:
    """``(characters fed, index, name)`` of each call's first delta."""
    return [(fed, call["index"], call["function"]["name"]) for fed, delta, _ in events
            for call in delta.get("tool_calls", ()) if "id" in call]


def test_tagged_auto_calls_stream_as_they_are_written():
    """Hermes' and Mistral's calls go out one by one: each once its name is whole, its arguments as written (a JSON
    string of arguments once whole, as its text; a call without arguments gets {} at the end)."""
    events = streamed(ToolOutput("auto", HermesParser(), True), HERMES_TWO)
    assert first_deltas(events) == [(HERMES_TWO.index('"get_weather"') + 13, 0, "get_weather"),
                                    (HERMES_TWO.index('"get_time"') + 10, 1, "get_time"),
                                    (HERMES_TWO.index('"now"') + 5, 2, "now")]
    content, calls, finish = joined_calls([{"choices": [{"index": 0, "delta": d, "finish_reason": f}]}
                                           for _, d, f in events])
    assert content == "Let me check. " and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Oslo"}'),
                                                            ("get_time", '{"zone": "UTC"}'), ("now", "{}")]
    middle = HERMES_TWO.index('Oslo')  # the first call's arguments are sent as they come, not at its end
    assert "".join(c["function"]["arguments"] for fed, d, _ in events if fed <= middle
                   for c in d.get("tool_calls", ()) if c["index"] == 0) == '{"city": "'
    events = streamed(ToolOutput("auto", MistralParser(), True), MISTRAL_TWO)
    assert [(i, name) for _, i, name in first_deltas(events)] == [(0, "get_weather"), (1, "get_time")]
    assert first_deltas(events)[0][0] == MISTRAL_TWO.index("[ARGS]") + 6
    single = streamed(ToolOutput("auto", HermesParser(), False), HERMES_TWO)  # parallel_tool_calls false
    assert [name for _, _, name in first_deltas(single)] == ["get_weather"]


def test_whole_output_parsers_hold_their_calls_to_the_end():
    """Llama 3's JSON and Python-style lists are calls only if the whole output is: sent in one delta at the end."""
    for parser, text in [(Llama3JsonParser(), '{"name": "get_time", "parameters": {"zone": "UTC"}}'),
                         (PythonicParser(), '[get_time(zone="UTC")]')]:
        events = streamed(ToolOutput("auto", parser, True), text)
        assert [fed for fed, _, _ in first_deltas(events)] == [len(text)] and events[-1][2] == "tool_calls"


def test_a_streamed_call_that_turns_out_malformed_stays_sent():
    """A stream cannot take back a call: a Hermes block that is not JSON after its name has sent the call, and the
    finish reason stays the engine's; a whole response holds the text as content."""
    text = 'Hi <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}} oops</tool_call>'
    output = ToolOutput("auto", HermesParser(), True)
    events = streamed(output, text)
    assert [name for _, _, name in first_deltas(events)] == ["get_time"] and events[-1][2] == "stop"
    assert ToolOutput("auto", HermesParser(), True).message(text, "stop") == {
        "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}


def test_required_calls_stream_one_by_one_as_written():
    """A ``"required"`` stream sends each call once its name is whole and its arguments as they are written (the
    model's own text: whitespace, escapes and brackets inside strings kept), not all at the end."""
    output, events = ToolOutput("required", None, True), []
    for i, char in enumerate(REQUIRED_TWO):
        delta, finish = output.delta(char, "stop" if i == len(REQUIRED_TWO) - 1 else None)
        events.append((i, delta, finish))
    firsts = [(i, d["tool_calls"][0]) for i, d, _ in events if d.get("tool_calls") and "id" in d["tool_calls"][0]]
    assert [(i, call["index"], call["function"]["name"]) for i, call in firsts] == [
        (REQUIRED_TWO.index('"get_weather"') + 12, 0, "get_weather"),
        (REQUIRED_TWO.index('"get_time"') + 9, 1, "get_time")]
    assert firsts[0][1]["id"] != firsts[1][1]["id"] and all(c["type"] == "function" for _, c in firsts)
    arguments = ["", ""]
    for i, delta, _ in events:
        for call in delta.get("tool_calls", ()):
            arguments[call["index"]] += call["function"]["arguments"]
        if i == REQUIRED_TWO.index("[1, {"):  # the first call's arguments up to here are sent already
            assert arguments[0] == '{"city": "O\\"s]}lo", "days": ['
    assert arguments == ['{"city": "O\\"s]}lo", "days": [1, {"n": 2}]}', '{ "zone" : "UTC" }']
    assert [json.loads(a) for a in arguments] == [{"city": 'O"s]}lo', "days": [1, {"n": 2}]}, {"zone": "UTC"}]
    assert [f for _, d, f in events if f] == ["tool_calls"] and not any("content" in d for _, d, _ in events)


def test_a_forced_function_without_text_makes_no_call():
    """A reasoning model may end in its thinking (its constraint holds after it): the answer is empty, and a forced
    function's empty arguments are no call, whole or streamed."""
    assert ToolOutput("get_weather", None, True).message("", "stop") == {
        "message": {"role": "assistant", "content": None}, "finish_reason": "stop"}
    output = ToolOutput("get_weather", None, True)
    assert output.delta("", None) == ({}, None) and output.delta("", "stop") == ({}, "stop")


def test_a_required_stream_cut_after_a_name_ends_as_cut():
    """Cut at ``max_tokens`` inside the list: before any name is whole the text is content (as a whole response
    has it); after one, the calls begun are sent, the last arguments unfinished, and the finish stays "length"."""
    assert ToolOutput("required", None, True).delta('[{"name": "get_ti', "length") == ({"content": '[{"name": "get_ti'},
                                                                                     "length")
    output = ToolOutput("required", None, True)
    first, _ = output.delta('[{"name": "get_time", "parameters": {"zo', None)
    assert first["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"zo'}
    assert output.delta('ne": "U', "length") == ({"tool_calls": [{"index": 0, "function": {"arguments": 'ne": "U'}}]},
                                                "length")


def test_the_call_list_reader_finds_names_and_arguments_as_they_come():
    """Scalar arguments wait until they end; a key given twice counts its last value (as ``json.loads``); keys
    inside the arguments are not the item's."""
    reader = CallReader()
    reader.feed('[{"name": "f", "parameters": 12')
    call = reader.calls[0]
    assert call.name == "f" and reader.written(call) == call.start  # the number may go on
    reader.feed('5 }, {"parameters": {"a": 1}, "parameters": "s", "name": "g"}]')
    assert [(c.name, reader.text[c.start:c.end]) for c in reader.calls] == [("f", "125"), ("g", '"s"')]
    assert [(c.name, c.arguments) for c in required_calls(reader.text)] == [("f", "125"), ("g", '"s"')]


JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                              st.text(alphabet='ab"\\]}{[ :,\n\u00e9', max_size=6)),
                    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(
                        st.sampled_from(["name", "arguments", "parameters", "k"]), inner, max_size=3)), max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(calls=st.lists(st.tuples(st.text(max_size=4), st.sampled_from(["arguments", "parameters"]), JSON),
                      min_size=1, max_size=3),
       form=st.sampled_from(["list", "list-indented", "compact", "semicolons"]), sizes=st.lists(st.integers(1, 9)))
def test_the_call_reader_reads_any_json_calls_in_any_pieces(calls, form, sizes):
    """Every call's name and the span of its arguments, whatever the values, whitespace and pieces; what it says is
    written is always the start of the value."""
    items = [{"name": name, key: value} for name, key, value in calls]
    if form == "semicolons":
        text = "; ".join(json.dumps(item) for item in items)
    else:
        text = json.dumps(items, indent=2 if form == "list-indented" else None,
                          separators=(",", ":") if form == "compact" else None)
    reader, at, said = CallReader(), 0, []
    for size in sizes + [len(text)]:
        reader.feed(text[at:at + size])
        at += size
        said += [(i, reader.written(call)) for i, call in enumerate(reader.calls) if reader.written(call) is not None]
    assert [(c.name, json.loads(text[c.start:c.end])) for c in reader.calls] == [
        (item["name"], value) for item, (_, _, value) in zip(items, calls)]
    assert all(reader.calls[i].start <= written <= reader.calls[i].end for i, written in said)  # never past it


# ---------------------------------------------------------------------------------------------- offline
def test_llm_chat_offers_the_tools_and_renders_earlier_calls(plain):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = plain.chat(history, SamplingParams(max_tokens=2), chat_template=TEMPLATE, tools=TOOLS)[0]
    assert out.prompt == ("<tools> get_weather,get_time\n<user> weather?\n<assistant> [get_weather Oslo]\n"
                          "<tool> sunny(call_1)\n<assistant> ")
    for messages, tools, words in [(ASK, [{"type": "function"}], r"tools\[0\] must be"),
                                   ([{"role": "tool"}], None, r"messages\[0\]'s content"),
                                   ([{"role": "assistant", "tool_calls": [{"function": {"name": 3}}]}], None,
                                    "tool_calls must be"),
                                   ([{"role": "tool", "content": "x", "tool_call_id": 5}], None, "tool_call_id")]:
        with pytest.raises(SpecDecError, match=words):
            plain.chat(messages, SamplingParams(max_tokens=2), chat_template=TEMPLATE, tools=tools)


# ---------------------------------------------------------------------------------------------- served
def test_a_forced_function_is_its_arguments_and_equals_plain_decoding(server, plain):
    """``tool_choice`` naming a function: the output is constrained to its parameters and comes back as its call;
    greedy under speculation it equals plain decoding under the same constraint; streamed, the arguments add up."""
    response = post(server, {"messages": ASK, "tools": TOOLS, "tool_choice": FORCED, "temperature": 0,
                             "max_tokens": 40, **COMPACT})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    call = choice["message"]["tool_calls"][0]
    assert choice["message"]["content"] is None and choice["finish_reason"] == "stop", call
    assert call["type"] == "function" and call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    constrained = StructuredOutputsParams(json=WEATHER["function"]["parameters"], disable_any_whitespace=True)
    reference = plain.chat(ASK, SamplingParams(temperature=0, max_tokens=40, structured_outputs=constrained),
                           chat_template=TEMPLATE, tools=TOOLS)[0].outputs[0].text
    assert call["function"]["arguments"] == reference
    content, calls, finish = joined_calls(stream(server, {"messages": ASK, "tools": TOOLS, "tool_choice": FORCED,
                                                          "temperature": 0, "max_tokens": 40, **COMPACT}))
    assert (content, [(c["name"], c["arguments"]) for c in calls], finish) == ("", [("get_weather", reference)],
                                                                                "stop")


def check_calls(calls: list[dict]) -> None:
    for call in calls:
        tool = next(t for t in TOOLS if t["function"]["name"] == call["function"]["name"])
        jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])


def test_required_calls_are_valid_calls(server):
    """``tool_choice`` required: a list of calls, each valid for its tool (one alone without parallel calls);
    streamed alike; an output cut at max_tokens comes back as text."""
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 0.8, "max_tokens": 60,
            "n": 3, "seed": 3, "parallel_tool_calls": False, **COMPACT}
    response = post(server, body)
    assert response.status_code == 200, response.text
    streamed = stream(server, body)
    for choice in response.json()["choices"]:
        calls = choice["message"].get("tool_calls")
        assert choice["finish_reason"] == "tool_calls" and len(calls) == 1 and choice["message"]["content"] is None
        check_calls(calls)
        content, got, finish = joined_calls(streamed, choice["index"])
        assert [(c["name"], c["arguments"]) for c in got] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in calls] and finish == "tool_calls"
    for choice in post(server, {**body, "parallel_tool_calls": True, "n": 4}).json()["choices"]:
        message = choice["message"]
        if choice["finish_reason"] == "tool_calls":
            check_calls(message["tool_calls"])
        else:  # a random model may list calls until max_tokens
            assert choice["finish_reason"] == "length" and "tool_calls" not in message
            assert message["content"].startswith('[{"name":')


def test_auto_reads_the_calls_out_of_the_text(server):
    """With ``tool_choice`` auto the hermes parser reads the calls (the output forced into hermes' form by a regex,
    since a random model writes none): content before them, ``finish_reason`` tool_calls; streamed alike; with
    ``tool_choice`` none the same text is content."""
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 120, "temperature": 0, "guided_regex": HERMES}
    message = post(server, body).json()["choices"][0]
    assert message["finish_reason"] == "tool_calls" and message["message"]["content"] == "Sure. ", message
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["message"][
        "tool_calls"]] == [("get_time", {"zone": "UTC"})]
    content, calls, finish = joined_calls(stream(server, body))
    assert (content, [c["name"] for c in calls], finish) == ("Sure. ", ["get_time"], "tool_calls")
    text = post(server, {**body, "tool_choice": "none"}).json()["choices"][0]
    assert text["finish_reason"] == "stop" and text["message"]["content"].startswith("Sure. <tool_call>")
    assert "tool_calls" not in text["message"]


def test_parallel_calls_off_keeps_the_first():
    text = ('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    names = [[c["function"]["name"] for c in ToolOutput("auto", HermesParser(), parallel).message(text, "stop")[
        "message"]["tool_calls"]] for parallel in (True, False)]
    assert names == [["get_time", "get_weather"], ["get_time"]]


def test_the_openai_clients_agent_loop(server):
    """The loop an agent runs: ask with tools, append the assistant's message with its call and the tool's result,
    ask again."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.root}/v1", api_key="none")
    messages = list(ASK)
    first = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice=FORCED,
                                           temperature=0, max_tokens=40, extra_body=COMPACT)
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in (
        "Paris", "Oslo", "Lima")
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none",
                                            max_tokens=3)
    assert second.choices[0].message.tool_calls is None and second.usage.prompt_tokens > first.usage.prompt_tokens
    chunks = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=FORCED,
                                            temperature=0, max_tokens=40, stream=True, extra_body=COMPACT)
    arguments = "".join(c.choices[0].delta.tool_calls[0].function.arguments or "" for c in chunks
                        if c.choices and c.choices[0].delta.tool_calls)
    assert arguments == call.function.arguments


BAD = [
    ({"tools": {"type": "function"}}, "tools", "valid list"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "letters, digits"),
    ({"tools": TOOLS, "tool_choice": "maybe"}, "tool_choice", "must be one of"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "no tools are given"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot also set response_format"),
    ({"tools": TOOLS, "tool_choice": FORCED, "structured_outputs": {"regex": "a"}}, "tool_choice",
     "cannot also set structured_outputs"),
    ({"tools": TOOLS, "tool_choice": FORCED, "structured_outputs": {"disable_any_whitespace": 1}},
     "structured_outputs", "disable_any_whitespace"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tools", "bogus"),
    ({"messages": [{"role": "tool"}]}, "messages.0", "content is missing"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
     "messages.0.tool_calls.0.function.arguments", "field required"),
    ({"messages": [{"role": "user", "content": "x", "refusal": "no"}]}, "messages.0.refusal", "should be none"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
]


@pytest.mark.parametrize("extra, param, words", BAD, ids=range(len(BAD)))
def test_bad_tools_are_a_400_naming_the_field(server, extra, param, words):
    response = post(server, {"messages": ASK, "max_tokens": 2, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_the_mistral_parser_reads_special_tokens(text_model_dirs, draft_dir):  # noqa: F811
    """Mistral's tags are special tokens: with its parser, an auto tool choice's text keeps special tokens (here the
    end-of-sequence token, made likely and not a stop with ignore_eos), where other requests' text leaves them out."""
    served = Served(create_app(make_llm(text_model_dirs, draft_dir, PLAIN), served_model_name="tiny", api_key="",
                               chat_template=TEMPLATE, enable_auto_tool_choice=True, tool_call_parser="mistral"))
    try:
        eos = served.state.llm.tokenizer.eos_token_id
        body = {"messages": ASK, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logit_bias": {str(eos): 50}}
        auto = post(None, {**body, "tools": TOOLS}, served.root).json()["choices"][0]["message"]["content"]
        plain = post(None, body, served.root).json()["choices"][0]["message"]["content"]
        assert auto == "<|endoftext|>" * 6 and plain == "", (auto, plain)
    finally:
        served.stop()


def test_auto_needs_the_servers_parser(text_model_dirs, draft_dir):  # noqa: F811
    with pytest.raises(SpecDecError, match="needs a tool-call parser"):
        create_app(make_llm(text_model_dirs, draft_dir, PLAIN), enable_auto_tool_choice=True)
    with pytest.raises(SpecDecError, match="unknown tool-call parser 'xml'"):
        create_app(make_llm(text_model_dirs, draft_dir, PLAIN), tool_call_parser="xml")
    served = Served(create_app(make_llm(text_model_dirs, draft_dir, PLAIN), served_model_name="tiny", api_key="",
                               chat_template=TEMPLATE))
    try:
        error = post(None, {"messages": ASK, "tools": TOOLS, "max_tokens": 2}, served.root).json()["error"]
        assert error["param"] == "tool_choice" and "--enable-auto-tool-choice" in error["message"]
        forced = post(None, {"messages": ASK, "tools": TOOLS, "tool_choice": FORCED, "max_tokens": 40, **COMPACT},
                      served.root)
        assert forced.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    finally:
        served.stop()
