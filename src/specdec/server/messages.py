"""Anthropic's Messages API answer (``POST /v1/messages``): a chat request's output (:class:`ChatOutputs`:
reasoning, content and tool calls) as a message of content blocks, whole or as its stream of events, and errors in
Anthropic's shape.

Content blocks, in the order the model wrote them: a ``thinking`` block (where a reasoning parser is served; its
``signature`` is empty: nothing here signs thinking), a ``text`` block and one ``tool_use`` block per call (its
``input`` the call's arguments as an object). ``stop_reason``: ``end_turn``, ``stop_sequence`` (with the
``stop_sequence`` that matched), ``max_tokens`` or ``tool_use``. A stream sends ``message_start``; per block
``content_block_start``, its deltas (``text_delta``, ``thinking_delta``, ``input_json_delta``: a call's arguments as
they are written) and ``content_block_stop``; then ``message_delta`` (the stop reason and the output's usage) and
``message_stop``. An error once the stream has begun is an ``error`` event. ``usage.input_tokens`` counts the
prompt's tokens the prefix cache did not hold, ``cache_read_input_tokens`` those it held, as Anthropic counts them.
"""

from __future__ import annotations

import copy
import json
import uuid
from typing import Any

from specdec.server.chat_output import ChatOutputs
from specdec.server.messages_request import MessagesRequest
from specdec.server.protocol import USAGE_EXTENSION, APIError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
"""Anthropic's error type of each status (any other: ``invalid_request_error`` below 500, ``api_error`` from 500)."""

TEXT = {"text": ("text", "text_delta"), "thinking": ("thinking", "thinking_delta")}
"""Each text block type: the field that holds its text and its delta's type."""


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class MessageShape:
    """One message being built from its chat deltas (:meth:`feed`, then :meth:`finish`); each step returns the
    stream events it makes."""

    def __init__(self, req: MessagesRequest, model: str, chat: ChatOutputs, input_tokens: int) -> None:
        self.req, self.model, self.chat, self.stream = req, model, chat, req.stream
        self.id = f"msg_{uuid.uuid4().hex}"
        self.input_tokens = input_tokens
        self.blocks: list[dict[str, Any]] = []  # tool_use blocks hold their arguments' text until the end
        self.open = False
        self.calls: dict[int, int] = {}  # a chat tool call's index -> its block's index

    def opening(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": {**self._head(), "content": [], "stop_reason": None,
                                                     "stop_sequence": None,
                                                     "usage": {"input_tokens": self.input_tokens,
                                                               "output_tokens": 0}}}]

    def error(self, exc: APIError) -> dict[str, Any]:
        return anthropic_error(exc.status, exc.message)

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat delta (a whole message is one delta too)."""
        events = []
        if delta.get("reasoning_content"):
            events += self._text("thinking", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("text", delta["content"])
        for call in delta.get("tool_calls") or ():
            index = call.get("index", len(self.calls))
            arguments = call["function"].get("arguments") or ""
            if "id" in call:  # a call's first delta
                events += self._open({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                                      "input": {}})
                self.blocks[-1]["input"] = ""  # the arguments' text, an object at the end
                self.calls[index] = len(self.blocks) - 1
            if arguments:
                self.blocks[self.calls[index]]["input"] += arguments
                events.append({"type": "content_block_delta", "index": self.calls[index],
                               "delta": {"type": "input_json_delta", "partial_json": arguments}})
        return events

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        field, delta = TEXT[kind]
        events = []
        if not (self.open and self.blocks[-1]["type"] == kind):
            events += self._open({"type": kind, field: "", **({"signature": ""} if kind == "thinking" else {})})
        self.blocks[-1][field] += text
        events.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                       "delta": {"type": delta, field: text}})
        return events

    def _open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.blocks.append(block)
        self.open = True
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1,
                          "content_block": copy.deepcopy(block)}]

    def _close(self) -> list[dict[str, Any]]:
        if not self.open:
            return []
        self.open = False
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def finish(self, finish_reason: str | None, stop: str | int | None, usage: dict[str, Any]
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing events and the whole message (``stop``: the engine's ``stop_reason``, the stop string
        that matched or the stop token)."""
        matched = isinstance(stop, str) and finish_reason == "stop"
        calls = any(b["type"] == "tool_use" for b in self.blocks)  # a forced call's chat finish is "stop"
        reason = ("max_tokens" if finish_reason == "length" else "tool_use" if calls else
                  "stop_sequence" if matched else "end_turn")
        usage = self._usage(usage)
        message = {**self._head(), "content": [self._whole(b) for b in self.blocks], "stop_reason": reason,
                   "stop_sequence": stop if matched else None, "usage": usage}
        events = self._close() + [
            {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": message["stop_sequence"]},
             "usage": usage},
            {"type": "message_stop"}]
        return events, message

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    @staticmethod
    def _whole(block: dict[str, Any]) -> dict[str, Any]:
        """A block as a whole message holds it: a call's arguments as an object."""
        if block["type"] != "tool_use":
            return dict(block)
        try:
            arguments = json.loads(block["input"] or "{}")
        except ValueError:
            arguments = None
        return {**block, "input": arguments if isinstance(arguments, dict) else {}}

    @staticmethod
    def _usage(chat: dict[str, Any]) -> dict[str, Any]:
        cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {"input_tokens": chat["prompt_tokens"] - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": chat["completion_tokens"],
                **({USAGE_EXTENSION: chat[USAGE_EXTENSION]} if USAGE_EXTENSION in chat else {})}
