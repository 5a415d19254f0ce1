"""Tool calls written as JSON, read as they are generated: ``{"name": N, "arguments": {...}}`` objects (or
``"parameters"``), one after another (``{...}; {...}``) or in a list (``[{...}, {...}]``). A ``"required"`` tool
choice's output is such a list (:func:`specdec.tools.schema`), and the Hermes, Llama 3 JSON and Mistral parsers
read their calls out of such text (:mod:`specdec.tools`).

:class:`CallReader` is fed the text piece by piece and knows, at any point, each call begun so far: its name once
the name's string is whole, and how much of its arguments is surely written. The arguments are the arguments
value's text as the model wrote it (whitespace inside it kept; a JSON string value stands for its contents,
:func:`arguments_text`), so a stream that sends each call's arguments as they come adds up to the whole response's.
An object or list value is surely written up to the last character read; a string or other scalar value only once
it has ended.

Terms: an *item* is an object at the top level or directly in a top-level list (one call); a *key* is one of an
item's own keys (``"name"``, ``"arguments"``, ``"parameters"``; others are ignored): a ``"name"`` inside the
arguments is part of the arguments. An item's arguments are its ``"arguments"`` value, else its ``"parameters"``
value; a key given twice counts its last value, as ``json.loads`` does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ARGUMENT_KEYS = ("arguments", "parameters")
_SCALAR_ENDS = frozenset(" \t\r\n,]}")


@dataclass
class Call:
    """One item: ``name`` once its string is whole (None before), and its arguments' span in the text: ``start``
    where the value begins, ``end`` just past it once it has ended (None before), ``key`` the key it is under."""

    name: str | None = None
    start: int | None = None
    end: int | None = None
    key: str | None = None


class CallReader:
    """Reads JSON calls fed in pieces (:meth:`feed`); ``calls`` holds every item begun so far.

    It tracks strings (with escapes), the nesting of ``[`` and ``{``, which key of an item is being read and where
    its arguments value begins and ends. It does not validate: text that is not JSON calls gives calls without
    names or spans (``json.loads`` decides whether a whole output holds well-formed calls)."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[Call] = []
        self._depth = 0
        self._top = ""  # the bracket that opened the top-level value
        self._item: int | None = None  # the depth inside the current item's object (1 or 2), None outside one
        self._string: int | None = None  # where the string being read began
        self._escaped = False  # the last character in that string was an unescaped backslash
        self._expect_key = False  # at the item's depth, the next string is a key
        self._key: str | None = None  # the item key whose value is being read
        self._value = False  # a value's first character is next (after its ':')
        self._arguments = False  # the value being read is the current call's arguments
        self._held = False  # ... and it is a string or other scalar (surely written only once it has ended)

    def feed(self, piece: str) -> None:
        """Read ``piece``, the text that follows what was fed before."""
        start = len(self.text)
        self.text += piece
        for i in range(start, len(self.text)):
            self._read(i, self.text[i])

    def written(self, call: Call) -> int | None:
        """How far into the text ``call``'s arguments are surely written (its span from ``call.start`` up to this),
        or None before they begin."""
        if call.start is None:
            return None
        if call.end is not None:
            return call.end
        return call.start if self._held and call is self.calls[-1] else len(self.text)

    def _read(self, i: int, c: str) -> None:
        if self._string is not None:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._end_string(i)
            return
        at_item = self._item is not None and self._depth == self._item
        if self._held and self._arguments and c in _SCALAR_ENDS:
            self._end_arguments(i)
        if at_item and self._value and not c.isspace():
            self._begin_value(i, c)
        if c == '"':
            self._string = i
        elif c in "[{":
            if c == "{" and self._item is None and (self._depth == 0 or self._depth == 1 and self._top == "["):
                self.calls.append(Call())
                self._item, self._expect_key, self._key = self._depth + 1, True, None
            if self._depth == 0:
                self._top = c
            self._depth += 1
        elif c in "]}":
            self._depth = max(self._depth - 1, 0)
            if self._item is not None and self._depth == self._item and self._arguments:
                self._end_arguments(i + 1)
            elif self._item is not None and self._depth < self._item:
                self._item = None
        elif at_item and c == ",":
            self._expect_key, self._key = True, None
        elif at_item and c == ":":
            self._expect_key, self._value = False, True

    def _begin_value(self, i: int, c: str) -> None:
        """The value of ``self._key`` begins at ``i`` with ``c``; an arguments key's value is the call's span."""
        self._value = False
        call = self.calls[-1]
        if self._key not in ARGUMENT_KEYS or self._key == "parameters" and call.key == "arguments":
            return
        call.start, call.end, call.key = i, None, self._key
        self._arguments, self._held = True, c not in "[{"

    def _end_arguments(self, end: int) -> None:
        self.calls[-1].end = end
        self._arguments = self._held = False

    def _end_string(self, i: int) -> None:
        start, self._string = self._string, None
        if self._item is None or self._depth != self._item:
            return
        if self._arguments:  # a string value of the arguments key
            self._end_arguments(i + 1)
        elif self._expect_key:
            self._key = _decoded(self.text[start:i + 1])
        elif self._key == "name":
            self.calls[-1].name = _decoded(self.text[start:i + 1])


def arguments_text(value: str) -> str:
    """A call's arguments as OpenAI's API sends them (JSON text) from the text of its arguments value: the text
    itself, or for a JSON string value (a model that writes its arguments as JSON text) the string's contents."""
    if value.startswith('"'):
        decoded = _decoded(value)
        return value if decoded is None else decoded
    return value


def _decoded(literal: str) -> str | None:
    """A JSON string literal's value (None where it is not one)."""
    try:
        value = json.loads(literal)
    except ValueError:
        return None
    return value if isinstance(value, str) else None
