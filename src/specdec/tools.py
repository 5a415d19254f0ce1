"""Tool calling: OpenAI's ``tools`` and ``tool_choice``, in the prompt and in the output.

The prompt: the tools (``[{"type": "function", "function": {"name", "description", "parameters"}}]``) are
rendered by the chat template (transformers' ``apply_chat_template(tools=...)``), with the conversation's
earlier calls (an assistant message's ``tool_calls``) and their results (``tool`` messages).

The output, by ``tool_choice`` (:func:`check_tool_choice`):

- ``"none"``: text; the model still sees the tools.
- ``"auto"`` (the default with tools): the model chooses; a tool-call parser (:data:`PARSERS`, the server's
  ``--tool-call-parser``: Hermes' and Qwen's ``<tool_call>`` blocks, Llama 3's JSON, Python-style call lists,
  Mistral's ``[TOOL_CALLS]``) reads its calls out of the text, and the text before the first call stays the
  content.
- ``"required"``: the output is constrained (:func:`schema`) to a JSON list of one or more calls
  ``[{"name": N, "parameters": {...}}]``, each an instance of its tool's schema (vLLM's form).
- ``{"type": "function", "function": {"name": N}}``: the output is constrained to N's parameters schema, and
  it is N's arguments.

Constraints are exact under speculation (:mod:`specdec.structured`), so are the calls. A call's ``arguments`` are
JSON text, as in OpenAI's API.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from specdec.call_list import CallReader, arguments_text
from specdec.errors import SpecDecError, short_repr

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""A function's name, as OpenAI's API allows it (vLLM also allows dots)."""

CHOICES = ("none", "auto", "required")
FREE_CHOICES = ("none", "auto")
"""The tool choices that leave the output unconstrained."""
ANY_OBJECT: dict[str, Any] = {"type": "object"}
SHOWN = 80  # characters of a refused value an error message shows


def check_tools(tools: Any, where: str = "tools") -> list[dict[str, Any]] | None:
    """``tools`` (None or a list of ``{"type": "function", "function": {"name", "description"?, "parameters"?,
    "strict"?}}``) checked, for the chat template: names valid and distinct, parameters a JSON schema object.
    An empty list is no tools (None). A bad one is a :class:`SpecDecError` naming it (``where[i]``)."""
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise SpecDecError(f"{where} must be a list of tools, got {short_repr(tools, SHOWN)}")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        here = f"{where}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise SpecDecError(f"{here} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                               f"got {short_repr(tool, SHOWN)}")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise SpecDecError(f"{here}.function.name must be 1 to 64 letters, digits, '_', '-' or '.', got "
                               f"{short_repr(name, SHOWN)}")
        if name in names:
            raise SpecDecError(f"{here}.function.name {name!r} is given twice: tools must have distinct names")
        names.add(name)
        if not isinstance(function.get("description", ""), (str, type(None))):
            raise SpecDecError(f"{here}.function.description must be a string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise SpecDecError(f"{here}.function.parameters must be a JSON schema (an object), got "
                               f"{short_repr(parameters, SHOWN)}")
    return list(tools) or None


def check_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> str:
    """The tool choice as one string: ``"none"``, ``"auto"``, ``"required"`` or the name of the function it forces
    (OpenAI's ``{"type": "function", "function": {"name": N}}``). Absent (None): ``"auto"`` with tools, else
    ``"none"``, as in OpenAI's API. A bad one, or any but ``"none"`` without tools, is a :class:`SpecDecError`."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise SpecDecError(f"tool_choice must be one of {', '.join(CHOICES)} or a function, got {choice!r:.80}")
        name = choice
    elif (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str)):
        name = choice["function"]["name"]
        known = [t["function"]["name"] for t in tools or ()]
        if name not in known:
            raise SpecDecError(f"tool_choice names the function {name!r}, which is not in tools "
                               f"({', '.join(map(repr, known)) or 'none given'})")
        return name
    else:
        raise SpecDecError(f"tool_choice must be one of {', '.join(CHOICES)} or {{\"type\": \"function\", "
                           f"\"function\": {{\"name\": ...}}}}, got {short_repr(choice, SHOWN)}")
    if name != "none" and not tools:
        raise SpecDecError(f"tool_choice is {name!r} but no tools are given")
    return name


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or ANY_OBJECT


def schema(choice: str, tools: list[dict[str, Any]] | None, parallel: bool = True) -> dict[str, Any] | None:
    """The JSON schema ``choice`` (:func:`check_tool_choice`'s) constrains the output to: for ``"required"`` a
    list of one or more ``{"name", "parameters"}`` calls (one alone unless ``parallel``), for a function its
    parameters; else None (no constraint)."""
    if choice in FREE_CHOICES:
        return None
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                   "parameters": _parameters(t)},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools or ()]
        return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": calls}}
    return _parameters(next(t for t in tools or () if t["function"]["name"] == choice))


def openai_call_id() -> str:
    """A call's id as OpenAI's API writes them: ``call_`` and 24 hexadecimal digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """A call's id as Mistral's chat templates require them (they refuse any other): nine letters and digits."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the function's ``name``, its ``arguments`` as JSON text and its ``id`` (default
    :func:`openai_call_id`'s)."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", openai_call_id())

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's shape (``index``: the call's place, in a streamed delta)."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def required_calls(text: str, call_id: Any = openai_call_id) -> list[ToolCall] | None:
    """The calls of a ``"required"`` output (a JSON list of ``{"name", "parameters"}``), or None where the text is
    not one (an output cut at ``max_tokens``); ``call_id`` makes their ids. Each call's arguments are its
    ``parameters`` as the model wrote them (:func:`json_calls`, as a stream reads them)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items or not all(
            isinstance(i, dict) and isinstance(i.get("name"), str) and "parameters" in i for i in items):
        return None
    return json_calls(text, call_id, strings=False)


def json_calls(text: str, call_id: Any = openai_call_id, strings: bool = True) -> list[ToolCall]:
    """The calls in ``text``, well-formed JSON calls (checked before), read by :class:`CallReader`: each call's
    arguments as the model wrote them, ``{}`` where it gave none. ``strings``: a JSON string value stands for the
    arguments' JSON text (:func:`arguments_text`; a parser's calls), not for a string argument (``"required"``'s
    parameters, an instance of their schema)."""
    reader = CallReader()
    reader.feed(text)
    return [ToolCall(call.name, "{}" if call.start is None else _value(text[call.start:call.end], strings), call_id())
            for call in reader.calls]


def _value(arguments: str, strings: bool) -> str:
    return arguments_text(arguments) if strings else arguments


def _call_of(value: Any, call_id: Any = openai_call_id) -> ToolCall:
    """The call a parsed JSON value writes: ``{"name": N, "arguments": {...}}`` (or ``"parameters"``, the arguments
    an object or JSON text), its id made by ``call_id``; ValueError where it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ValueError(f"not a call: {short_repr(value, SHOWN)}")
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                                          ensure_ascii=False),
                    call_id())


class ToolParser(Protocol):
    """How one family of models writes its calls. ``special_tokens``: the calls are marked by special tokens, so
    the text they are read from keeps them (``skip_special_tokens`` off, as vLLM's parsers that need it ask);
    ``call_id``: makes the ids of the calls the model makes (any call, with this parser: the ids go back into
    the model's own template on a later turn)."""

    special_tokens: bool
    call_id: Any

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a whole output (content None where there is none)."""

    def content_end(self, text: str, start: int = 0) -> int:
        """How many characters of a partial output are surely content (streamed before the output ends), given that
        its first ``start`` are (what was streamed before: a stream is read once)."""

    def call_json(self, text: str, final: bool = False) -> str | None:
        """The JSON calls (:mod:`specdec.call_list`) surely written in an output so far, for a stream to send as
        they come: text that only grows as the output does (``final``: the output is whole), or None where the
        calls are known only once the output is whole (or none has begun)."""


def _whole_output_end(text: str, start: int, opening: str, tag: str) -> int:
    """``content_end`` of a parser whose calls are the whole output: none of a partial output while it may be calls
    (blank, beginning with ``opening``, with ``tag`` or a beginning of it), all of it once it is not (so all of it
    once some was content: ``start`` above 0)."""
    if start:
        return len(text)
    begin = text.lstrip()
    if not begin or begin[0] == opening or begin.startswith(tag) or tag.startswith(begin):
        return 0
    return len(text)


def _tagged_calls(parser: ToolParser, text: str, tag: str, check: Any) -> tuple[str | None, list[ToolCall]]:
    """``parse`` of a parser whose calls follow the content, each block after a ``tag`` holding calls that
    ``check(block)`` accepts (a ValueError where they are malformed), read from ``parser.call_json``:
    ``(content, calls)``, the content None where only blanks come before the first ``tag``; text whose calls are
    not all well-formed is all content."""
    start = text.find(tag)
    if start < 0:
        return text, []
    try:
        for block in text[start + len(tag):].split(tag):
            check(block)
    except ValueError:
        return text, []
    calls = json_calls(parser.call_json(text, final=True), parser.call_id)
    content = text[:start]
    return (content if content.strip() else None, calls) if calls else (text, [])


def _unheld(text: str, *tags: str) -> int:
    """How much of ``text`` may be read now: all but an ending that may begin one of ``tags``."""
    for keep in range(min(max(map(len, tags)) - 1, len(text)), 0, -1):
        if any(tag.startswith(text[-keep:]) for tag in tags):
            return len(text) - keep
    return len(text)


def _tag_content_end(text: str, start: int, tag: str) -> int:
    """``content_end`` of a parser whose calls follow content and begin with ``tag``: up to the first ``tag``, or
    short of an ending that may begin one."""
    found = text.find(tag, start)
    return found if found >= 0 else max(start, _unheld(text, tag))


class HermesParser:
    """Hermes' and Qwen's calls (Qwen 2.5 and 3, NousResearch Hermes 2 and 3): each a JSON object
    ``{"name": N, "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; the text before the first
    call is the content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    special_tokens = False
    call_id = staticmethod(openai_call_id)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return _tagged_calls(self, text, self.OPEN, lambda block: _call_of(json.loads(block.split(self.CLOSE, 1)[0])))

    def content_end(self, text: str, start: int = 0) -> int:
        return _tag_content_end(text, start, self.OPEN)

    def call_json(self, text: str, final: bool = False) -> str | None:
        """Each block's JSON, up to its ``</tool_call>`` (the last one short of an ending that may begin a tag)."""
        start = text.find(self.OPEN)
        if start < 0:
            return None
        blocks = [block.split(self.CLOSE, 1)[0] for block in text[start + len(self.OPEN):].split(self.OPEN)]
        if not final and self.CLOSE not in text[text.rfind(self.OPEN):]:
            blocks[-1] = blocks[-1][:_unheld(blocks[-1], self.OPEN, self.CLOSE)]
        return "".join(blocks)


class Llama3JsonParser:
    """Llama 3.1 to 3.3's JSON calls: an output that is one call ``{"name": N, "parameters": {...}}`` (or
    ``"arguments"``), or several separated by ``;``, optionally after ``<|python_tag|>``; any other output is
    content."""

    TAG = "<|python_tag|>"
    special_tokens = False
    call_id = staticmethod(openai_call_id)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of an output: ``(None, calls)`` when all of it is well-formed calls, else
        ``(text, [])``."""
        body = text.strip()
        body = body[len(self.TAG):].lstrip() if body.startswith(self.TAG) else body
        if not body.startswith("{"):
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                value, at = decoder.raw_decode(body, at)
                calls.append(_call_of(value))
            except ValueError:
                return text, []
            while at < len(body) and (body[at].isspace() or body[at] == ";"):
                at += 1
        return None, calls

    def content_end(self, text: str, start: int = 0) -> int:
        return _whole_output_end(text, start, "{", self.TAG)

    def call_json(self, text: str, final: bool = False) -> None:
        """None: the calls are the whole output, known as calls only once it is whole."""
        return None


class PythonicParser:
    """Calls written as a Python list of calls with keyword arguments, ``[get_weather(city="Oslo"), get_time()]``
    (Llama 3.2 and 4, and other models vLLM's ``pythonic`` parser reads), optionally between ``<|python_start|>`` and
    ``<|python_end|>``; an output that is not such a list is content. Argument values are Python literals (strings,
    numbers, booleans, None, lists, dicts) and become JSON."""

    OPEN, CLOSE = "<|python_start|>", "<|python_end|>"
    special_tokens = False
    call_id = staticmethod(openai_call_id)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(None, calls)`` when the whole output is a list of calls, else ``(text, [])``."""
        body = text.strip()
        if body.startswith(self.OPEN):
            body = body[len(self.OPEN):].removesuffix(self.CLOSE).strip()
        if not (body.startswith("[") and body.endswith("]")):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not all(
                    isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and not c.args for c in tree.elts):
                return text, []
            calls = [ToolCall(c.func.id, json.dumps({k.arg: ast.literal_eval(k.value) for k in c.keywords},
                                                    ensure_ascii=False)) for c in tree.elts]
        except (SyntaxError, ValueError, TypeError, RecursionError):  # not literals, **kwargs, NaN, too deep
            return text, []
        return None, calls

    def content_end(self, text: str, start: int = 0) -> int:
        return _whole_output_end(text, start, "[", self.OPEN)

    def call_json(self, text: str, final: bool = False) -> None:
        """None: the calls are the whole output, known as calls only once it is whole."""
        return None


class MistralParser:
    """Mistral's calls (Mistral 7B Instruct v0.3, Nemo, Small, Large): the special token ``[TOOL_CALLS]`` and then
    a JSON list of ``{"name": N, "arguments": {...}}`` (tokenizers before v11), or each call after its own
    ``[TOOL_CALLS]`` as ``N[ARGS]{...}`` (v11 on, ``[ARGS]`` a special token too); the text before the first
    ``[TOOL_CALLS]`` is the content. Its ids are :func:`mistral_call_id`'s: Mistral's templates refuse others."""

    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
    special_tokens = True
    call_id = staticmethod(mistral_call_id)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return _tagged_calls(self, text, self.TAG, self._check)

    def _check(self, block: str) -> None:
        """A ValueError where one ``[TOOL_CALLS]`` block holds no well-formed call."""
        block = block.strip()
        if self.ARGS in block:
            name, arguments = block.split(self.ARGS, 1)
            if not NAME.fullmatch(name.strip()):
                raise ValueError(f"not a function name: {short_repr(name, SHOWN)}")
            json.loads(arguments)
            return
        value = json.loads(block)
        if not [_call_of(item) for item in (value if isinstance(value, list) else [value])]:
            raise ValueError("no calls")

    def content_end(self, text: str, start: int = 0) -> int:
        return _tag_content_end(text, start, self.TAG)

    def call_json(self, text: str, final: bool = False) -> str | None:
        """Each block's JSON (the last one short of an ending that may begin a tag); a ``N[ARGS]{...}`` block as
        ``{"name": N, "arguments": {...}}``, from its ``[ARGS]`` on."""
        start = text.find(self.TAG)
        if start < 0:
            return None
        blocks = text[start + len(self.TAG):].split(self.TAG)
        if not final:
            blocks[-1] = blocks[-1][:_unheld(blocks[-1], self.TAG)]
        json_text = []
        for i, block in enumerate(blocks):
            if block.lstrip()[:1] in ("[", "{"):
                json_text.append(block)
            elif self.ARGS in block:
                name, arguments = block.split(self.ARGS, 1)
                ended = "}" if final or i < len(blocks) - 1 else ""
                json_text.append(f'{{"name": {json.dumps(name.strip())}, "arguments": {arguments}{ended}')
        return "".join(json_text)


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
                                        "pythonic": PythonicParser, "mistral": MistralParser}
"""Tool-call parsers by name (the server's ``--tool-call-parser``)."""


def tool_parser(name: str) -> ToolParser:
    """The parser named ``name`` (:data:`PARSERS`), or a :class:`SpecDecError` listing them."""
    if name not in PARSERS:
        raise SpecDecError(f"unknown tool-call parser {name!r}: specdec has {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()


def tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An OpenAI conversation's calls as chat templates read them: each assistant ``tool_calls`` entry's
    ``function.arguments`` JSON text parsed into an object (what Hugging Face templates expect)."""
    shaped = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [
                {**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}}
                for c in calls]}
        shaped.append(message)
    return shaped


def _arguments(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text
