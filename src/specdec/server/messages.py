"""Anthropic's Messages API answer (``POST /v1/messages``): a chat request's output (:class:`ChatOutputs`:
reasoning, content and tool calls) as a message of content blocks, whole or as its stream of events, and errors in
Anthropic's shape.

Content blocks, in the order the model wrote them: a ``thinking`` block (where a reasoning parser is served; its
``signature`` is empty: nothing here signs thinking), a ``text`` block and one ``tool_use`` block per call (its
``input`` the call's arguments as an object). ``stop_reason``: ``end_turn``, ``stop_sequence`` (with the
``stop_sequence`` that matched), ``max_tokens`` or ``tool_use``. A stream sends ``message_start``; per block
``content_block_start``, its deltas (``text_delta``, ``thinking_delta``, ``input_json_delta``: a call's arguments as
they are written) and ``content_block_stop``; then ``message_delta`` (the stop reason and the usage) and
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
from specdec.server.output_items import OutputItems
from specdec.server.protocol import APIError, usage_parts

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
"""Anthropic's error type of each status (any other: ``invalid_request_error`` below 500, ``api_error`` from 500)."""

TEXT = {"text": ("text", "text_delta"), "thinking": ("thinking", "thinking_delta")}
"""Each text block type: the field that holds its text and its delta's type."""


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class MessageShape(OutputItems):
    """One message being built from its chat deltas (:meth:`feed`, then :meth:`finish`); each step returns the
    stream events it makes."""

    REASONING, CONTENT = "thinking", "text"

    def __init__(self, req: MessagesRequest, model: str, chat: ChatOutputs, input_tokens: int) -> None:
        super().__init__()  # its tool_use blocks hold their arguments' text until the end
        self.req, self.model, self.chat, self.stream = req, model, chat, req.stream
        self.id = f"msg_{uuid.uuid4().hex}"
        self.input_tokens = input_tokens

    def opening(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": {**self._head(), "content": [], "stop_reason": None,
                                                     "stop_sequence": None,
                                                     "usage": {"input_tokens": self.input_tokens,
                                                               "output_tokens": 0}}}]

    def error(self, exc: APIError) -> dict[str, Any]:
        return anthropic_error(exc.status, exc.message)

    def _text_item(self, kind: str) -> dict[str, Any]:
        return {"type": kind, TEXT[kind][0]: "", **({"signature": ""} if kind == "thinking" else {})}

    def _call_item(self, call: dict[str, Any]) -> dict[str, Any]:
        return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}}

    def _started(self, index: int) -> list[dict[str, Any]]:
        block = self.items[index]
        events = [{"type": "content_block_start", "index": index, "content_block": copy.deepcopy(block)}]
        if block["type"] == "tool_use":
            block["input"] = ""  # the arguments' text, an object at the end
        return events

    def _extended(self, index: int, text: str) -> list[dict[str, Any]]:
        block = self.items[index]
        if block["type"] == "tool_use":
            block["input"] += text
            return [{"type": "content_block_delta", "index": index,
                     "delta": {"type": "input_json_delta", "partial_json": text}}]
        field, delta = TEXT[block["type"]]
        block[field] += text
        return [{"type": "content_block_delta", "index": index, "delta": {"type": delta, field: text}}]

    def _stopped(self, index: int, status: str) -> list[dict[str, Any]]:
        return [{"type": "content_block_stop", "index": index}]

    def finish(self, finish_reason: str | None, stop: str | int | None, usage: dict[str, Any]
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing events and the whole message (``stop``: the engine's ``stop_reason``, the stop string
        that matched or the stop token)."""
        matched = isinstance(stop, str) and finish_reason == "stop"
        calls = any(b["type"] == "tool_use" for b in self.items)  # a forced call's chat finish is "stop"
        reason = ("max_tokens" if finish_reason == "length" else "tool_use" if calls else
                  "stop_sequence" if matched else "end_turn")
        usage = self._usage(usage)
        message = {**self._head(), "content": [self._whole(b) for b in self.items], "stop_reason": reason,
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
        cached, extension = usage_parts(chat)
        return {"input_tokens": chat["prompt_tokens"] - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": chat["completion_tokens"], **extension}
