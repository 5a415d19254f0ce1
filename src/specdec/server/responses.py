"""The Responses API's answer (``POST /v1/responses``): a chat request's output (:class:`ChatOutputs`: reasoning,
content and tool calls) as a response object with output items, whole or as its stream of typed events.

Output items, in the order the model wrote them: a ``reasoning`` item (the thinking, where a reasoning parser is
served), a ``message`` item (the answer, one ``output_text`` part), and one ``function_call`` item per call. A
stream sends ``response.created`` and ``response.in_progress``; for each item ``response.output_item.added``, its
part's ``response.content_part.added``, the deltas (``response.reasoning_text.delta``,
``response.output_text.delta``, ``response.function_call_arguments.delta``), their ``.done`` events and
``response.output_item.done``; then ``response.completed``, or ``response.incomplete`` for an output cut at
``max_output_tokens``, with the whole response and its usage. Every event carries its ``sequence_number``. An
error once the stream has begun is an ``error`` event. A whole response is built by the same steps, so it holds
what the stream's last event holds.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable
from typing import Any

from specdec.server.chat_output import ChatOutputs
from specdec.server.output_items import OutputItems
from specdec.server.protocol import APIError, now, usage_parts
from specdec.server.responses_request import ResponsesRequest

PARTS = {"message": ("output_text", "response.output_text"), "reasoning": ("reasoning_text", "response.reasoning_text")}
"""Each text item's part type and its events' prefix."""


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseShape(OutputItems):
    """One response being built from its chat deltas (:meth:`feed`, then :meth:`finish`); each step returns the
    stream events it makes. ``keep``: what stores the finished response, where it is stored
    (:meth:`~specdec.server.response_store.ResponseStore.add`)."""

    REASONING, CONTENT = "reasoning", "message"

    def __init__(self, req: ResponsesRequest, model: str, chat: ChatOutputs,
                 keep: Callable[[dict[str, Any]], None] | None = None) -> None:
        super().__init__()
        self.req, self.model, self.chat, self.stream, self.keep = req, model, chat, req.stream, keep
        self.id, self.created = _id("resp"), now()
        self.sequence = 0

    def response(self, status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object (``status``: in_progress, completed or incomplete)."""
        req = self.req
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
                "output": copy.deepcopy(self.items), "parallel_tool_calls": req.parallel_tool_calls,
                "previous_response_id": req.previous_response_id, "reasoning": req.reasoning,
                "store": self.keep is not None,
                "temperature": req.temperature, "top_p": req.top_p, "text": {"format": fmt or {"type": "text"}},
                "tool_choice": req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none"),
                "tools": req.tools or [], "truncation": "disabled", "metadata": req.metadata or {},
                "user": req.user, "usage": usage}

    def opening(self) -> list[dict[str, Any]]:
        return [self.event(kind, response=self.response("in_progress"))
                for kind in ("response.created", "response.in_progress")]

    def error(self, exc: APIError) -> dict[str, Any]:
        return self.event("error", code=exc.code or exc.type, message=exc.message, param=exc.param)

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def _text_item(self, kind: str) -> dict[str, Any]:
        if kind == "message":
            return {"type": "message", "id": _id("msg"), "role": "assistant", "status": "in_progress", "content": []}
        return {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [], "status": "in_progress"}

    def _call_item(self, call: dict[str, Any]) -> dict[str, Any]:
        return {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": call["function"]["name"],
                "arguments": "", "status": "in_progress"}

    def _started(self, index: int) -> list[dict[str, Any]]:
        item = self.items[index]
        events = [self.event("response.output_item.added", output_index=index, item=copy.deepcopy(item))]
        if item["type"] in PARTS:  # a text item's one part
            part = {"type": PARTS[item["type"]][0], "text": "",
                    **({"annotations": []} if item["type"] == "message" else {})}
            item["content"].append(part)
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                     content_index=0, part=dict(part)))
        return events

    def _extended(self, index: int, text: str) -> list[dict[str, Any]]:
        item = self.items[index]
        if item["type"] == "function_call":
            item["arguments"] += text
            return [self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=text)]
        item["content"][0]["text"] += text
        extra = {"logprobs": []} if item["type"] == "message" else {}
        return [self.event(f"{PARTS[item['type']][1]}.delta", item_id=item["id"], output_index=index,
                           content_index=0, delta=text, **extra)]

    def _stopped(self, index: int, status: str) -> list[dict[str, Any]]:
        """The ``.done`` events of item ``index``, which is then whole."""
        item = self.items[index]
        item["status"] = status
        if item["type"] == "function_call":
            events = [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                 arguments=item["arguments"])]
        else:
            part = item["content"][0]
            events = [self.event(f"{PARTS[item['type']][1]}.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=part["text"]),
                      self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=dict(part))]
        return events + [self.event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    def finish(self, finish_reason: str | None, stop_reason: str | int | None, usage: dict[str, Any]
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing events and the whole response (incomplete where ``finish_reason`` is length)."""
        status = "incomplete" if finish_reason == "length" else "completed"
        events = self._close(status)
        response = self.response(status, _usage(usage))
        if self.keep is not None:
            self.keep(response)
        events.append(self.event(f"response.{status}", response=response))
        return events, response


def _usage(chat: dict[str, Any]) -> dict[str, Any]:
    """The Responses API's usage from the chat endpoint's (the speculative metrics kept under their key)."""
    cached, extension = usage_parts(chat)
    return {"input_tokens": chat["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat["completion_tokens"], "total_tokens": chat["total_tokens"], **extension}
