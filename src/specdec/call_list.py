"""A ``"required"`` tool choice's output read as it is generated: a JSON list of calls
``[{"name": N, "parameters": {...}}, ...]`` (the form :func:`specdec.tools.schema` constrains it to).

:class:`CallListReader` is fed the text piece by piece and knows, at any point, each call begun so far: its name
once the name's string is whole, and how much of its arguments is surely written. The arguments are the
``parameters`` value's text as the model wrote it (whitespace inside it kept), so a stream that sends each call's
arguments as they come adds up to the whole response's (:func:`specdec.tools.required_calls` reads them with this
reader too). An object or list value is surely written up to the last character read; a scalar value (a schema may
ask for one) only once it has ended.

Terms: the *list* is the top-level JSON array; an *item* is one of its objects (one call); a *key* is one of an
item's keys (``"name"``, ``"parameters"``; others are ignored). Only the item's own keys count: a ``"name"``
inside the arguments is part of the arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

LIST, ITEM = 1, 2  # nesting depths: inside the list, inside an item
_SCALAR_ENDS = frozenset(" \t\r\n,]}")


@dataclass
class Call:
    """One item of the list: ``name`` once its string is whole (None before), and its arguments' span in the
    text: ``start`` where the ``parameters`` value begins, ``end`` just past it once it has ended (None before)."""

    name: str | None = None
    start: int | None = None
    end: int | None = None


class CallListReader:
    """Reads a JSON list of calls fed in pieces (:meth:`feed`); ``calls`` holds every item begun so far.

    It tracks strings (with escapes), the nesting of ``[`` and ``{``, which key of an item is being read and
    where its ``parameters`` value begins and ends. It does not validate: text that is not such a list gives
    calls without names or spans (``json.loads`` decides whether a whole output is one)."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[Call] = []
        self._depth = 0
        self._string: int | None = None  # where the string being read began
        self._escaped = False  # the last character in that string was an unescaped backslash
        self._expect_key = False  # at ITEM depth, the next string is a key
        self._key: str | None = None  # the item key whose value is being read
        self._scalar = False  # a scalar parameters value is being read

    def feed(self, piece: str) -> None:
        """Read ``piece``, the text that follows what was fed before."""
        start = len(self.text)
        self.text += piece
        for i in range(start, len(self.text)):
            self._read(i, self.text[i])

    def written(self, call: Call) -> int | None:
        """How far into the text ``call``'s arguments are surely written (its span ``call.start`` up to this), or
        None before they begin."""
        if call.start is None:
            return None
        if call.end is not None:
            return call.end
        return call.start if self._scalar else len(self.text)

    def _read(self, i: int, c: str) -> None:
        if self._string is not None:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._end_string(i)
            return
        if self._scalar and c in _SCALAR_ENDS:
            self.calls[-1].end, self._scalar = i, False
        if c == '"':
            self._string = i
        elif c in "[{":
            if self._depth == ITEM and self._key == "parameters" and not self._expect_key:
                self.calls[-1].start = i
            elif self._depth == LIST and c == "{":
                self.calls.append(Call())
                self._expect_key, self._key = True, None
            self._depth += 1
        elif c in "]}":
            self._depth = max(self._depth - 1, 0)
            if self._depth == ITEM and self._key == "parameters":
                self.calls[-1].end = i + 1
        elif self._depth == ITEM and c == ",":
            self._expect_key, self._key = True, None
        elif self._depth == ITEM and c == ":":
            self._expect_key = False
        elif (self._depth == ITEM and self._key == "parameters" and not self._expect_key and not c.isspace()
              and not self._scalar and self.calls[-1].end is None):
            self.calls[-1].start, self._scalar = i, True

    def _end_string(self, i: int) -> None:
        start, self._string = self._string, None
        if self._depth != ITEM or not self.calls:
            return
        if self._expect_key:
            self._key = _decoded(self.text[start:i + 1])
            if self._key == "parameters":  # a key given twice: its last value counts, as in json.loads
                self.calls[-1].start = self.calls[-1].end = None
        elif self._key == "name":
            self.calls[-1].name = _decoded(self.text[start:i + 1])
        elif self._key == "parameters":
            self.calls[-1].start, self.calls[-1].end = start, i + 1


def _decoded(literal: str) -> str | None:
    """A JSON string literal's value (None where it is not one)."""
    try:
        value = json.loads(literal)
    except ValueError:
        return None
    return value if isinstance(value, str) else None
