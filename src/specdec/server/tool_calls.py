"""A chat choice's output as OpenAI's message: its text, or the tool calls it makes (:mod:`specdec.tools`).

By the request's tool choice:

- ``"none"`` (or no tools): the text is the content.
- ``"auto"``: the server's tool-call parser reads the calls; the text before the first is the content. Streamed,
  text is sent as content until it may begin a call. With a parser whose calls are tagged JSON (Hermes', Mistral's:
  :meth:`~specdec.tools.ToolParser.call_json`) each call then goes out as soon as its name is whole (the first
  delta with its ``index``, ``id`` and ``name``) and its arguments as they are written
  (:class:`~specdec.call_list.CallReader`). With the others (Llama 3's JSON, Python-style lists: the output is
  calls only if all of it is) the rest is held, and at the end the calls go out in one delta, or the held text as
  content where it held no well-formed call.
- ``"required"``: the constrained output, a JSON list of calls, becomes the calls, streamed as they come too.

A stream that sent a call cannot take it back: an output cut before its first name is text, as in a whole response;
one cut later (``max_tokens``), or whose calls turn out malformed, has sent the calls begun, its finish reason stays
``"length"`` or ``"stop"``, and the rest is dropped (a whole response holds such an output as content).
- a function: the constrained output is its arguments. Streamed, the arguments go out as they come, the first
  delta with the call's id and name. An output without text (a reasoning model's that ended in its thinking, which
  a constraint after the thinking allows, as in vLLM) makes no call.

A message with calls has ``content`` null unless text came before them, and ``finish_reason`` ``"tool_calls"``,
but for a forced function, whose finish reason stays the engine's (as OpenAI's API answers).
"""

from __future__ import annotations

from typing import Any

from specdec.call_list import Call, CallReader, arguments_text
from specdec.tools import CHOICES, ToolCall, ToolParser, openai_call_id, required_calls


class ToolOutput:
    """One choice's output under ``choice`` (:func:`specdec.tools.check_tool_choice`'s), read by ``parser`` where
    the choice is ``"auto"`` (and whose ``call_id`` makes every call's id: a model's template may require its own
    form); ``parallel``: more than one call may be kept. :meth:`message` shapes a whole response's message,
    :meth:`delta` a stream's deltas (one instance per streamed choice: it keeps what it has seen)."""

    def __init__(self, choice: str, parser: ToolParser | None, parallel: bool) -> None:
        self.choice, self.parser, self.parallel = choice, parser, parallel
        self.call_id = openai_call_id if parser is None else parser.call_id
        self.forced = choice not in CHOICES  # a function's name
        self.text = ""  # streamed so far
        self.sent = 0  # characters of it sent as content
        self.call: ToolCall | None = None  # a forced function's call, once its first delta is sent
        self.reader = CallReader()  # the JSON calls of a "required" or "auto" output, as they come
        self.ids: list[str] = []  # the ids of the calls whose first delta is sent
        self.args_sent: list[int | None] = []  # how far into the text each one's arguments are sent

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a whole output (calls empty where it made none)."""
        if self.forced:  # no text (a reasoning model's output that ended while thinking): no call
            return None, [ToolCall(self.choice, text, self.call_id())] if text else []
        if self.choice == "required":
            calls = required_calls(text, self.call_id)
            return (text, []) if calls is None else (None, calls)
        if self.choice == "auto" and self.parser is not None:
            content, calls = self.parser.parse(text)
            return content, calls if self.parallel else calls[:1]
        return text, []

    def finish(self, calls: list[ToolCall], finish_reason: str | None) -> str | None:
        return "tool_calls" if calls and not self.forced and finish_reason is not None else finish_reason

    def message(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        """A whole response's ``message`` and ``finish_reason``."""
        content, calls = self.calls(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.openai() for call in calls]
        return {"message": message, "finish_reason": self.finish(calls, finish_reason)}

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The delta to stream for a new piece of ``text`` (``finish_reason``: None until the last piece), and the
        finish reason to send with it."""
        self.text += text
        if self.forced:
            if not text:
                return {}, finish_reason
            if self.call is None:
                self.call = ToolCall(self.choice, text, self.call_id())
                return {"tool_calls": [self.call.openai(0)]}, finish_reason
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}, finish_reason
        if self.choice == "none" or self.choice == "auto" and self.parser is None:
            return ({"content": text} if text else {}), finish_reason
        final = finish_reason is not None
        content, whole = self.calls(self.text) if final else (None, [])
        calls = self._streamed_calls(final, bool(whole))
        if self.ids:  # the calls went out as they came
            delta = self._content(self._content_end())
            if calls:
                delta["tool_calls"] = calls
            return delta, "tool_calls" if whole else finish_reason
        if not final:
            return self._content(self._content_end()), None
        if not whole:
            return self._content(len(self.text)), finish_reason
        delta = self._content(len(content or "")) if content else {}
        delta["tool_calls"] = [call.openai(i) for i, call in enumerate(whole)]
        return delta, self.finish(whole, finish_reason)

    def _content_end(self) -> int:
        """How much of the text streamed so far is surely content."""
        return self.parser.content_end(self.text, self.sent) if self.choice == "auto" else 0

    def _streamed_calls(self, final: bool, whole: bool) -> list[dict[str, Any]]:
        """The call deltas of what the output's JSON calls (the ``"required"`` output itself, or the parser's
        :meth:`~specdec.tools.ToolParser.call_json`) add: each call named since the last delta (its ``index``,
        ``id`` and ``name``) and the arguments written since. ``whole``: the whole output's calls are
        well-formed (a call that gave no arguments then gets ``{}``, as a whole response has it)."""
        json_text = self.text if self.choice == "required" else self.parser.call_json(self.text, final)
        if json_text is None:
            return []
        self.reader.feed(json_text[len(self.reader.text):])
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(self.reader.calls):
            if call.name is None or index and not self.parallel:
                break
            if index == len(self.ids):
                self.ids.append(self.call_id())
                self.args_sent.append(None)
                deltas.append({"index": index, "id": self.ids[index], "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            piece = self._arguments(index, call, final and whole)
            if deltas and deltas[-1]["index"] == index:
                deltas[-1]["function"]["arguments"] += piece
            elif piece:
                deltas.append({"index": index, "function": {"arguments": piece}})
        return deltas

    def _arguments(self, index: int, call: Call, whole: bool) -> str:
        """Call ``index``'s arguments written since they were last sent: an object or list as it comes, a string
        or other scalar once it has ended."""
        text, sent, written = self.reader.text, self.args_sent[index], self.reader.written(call)
        if written is None:
            if whole and sent is None:
                self.args_sent[index] = 0
                return "{}"
            return ""
        if text[call.start] not in "[{":
            if call.end is None or sent is not None:
                return ""
            self.args_sent[index] = call.end
            value = text[call.start:call.end]
            return value if self.choice == "required" else arguments_text(value)  # as specdec.tools.json_calls
        self.args_sent[index] = written
        return text[call.start if sent is None else sent:written]

    def _content(self, end: int) -> dict[str, Any]:
        """The content from what was sent up to ``end``, as a delta."""
        piece, self.sent = self.text[self.sent:end], max(self.sent, end)
        return {"content": piece} if piece else {}
