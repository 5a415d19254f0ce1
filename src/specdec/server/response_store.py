"""Stored responses of the Responses API: what ``store`` (true by default, as in OpenAI's API) keeps, so that a later
request continues a conversation by ``previous_response_id`` alone, and ``GET /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items`` and ``DELETE /v1/responses/{id}`` read or remove it.

Terms:

- a response's **input items**: its request's ``input`` as items (a string is one user message), each with an
  ``id`` (the client's, or one given here), message texts as content parts;
- its **context**: what a request continuing it starts from: the items it was shown after its ``instructions``
  (the context of the response it continued, then its own input items) and its output. A request with
  ``previous_response_id`` is read as if it had sent that response's context before its own ``input``
  (:class:`Turn`); ``instructions`` are not carried over (OpenAI's rule: each request gives its own). With prefix
  caching the continued prompt's tokens are read from the cache.

A response is stored when it finishes (completed, or incomplete at ``max_output_tokens``): a stream the client
left, or one ended by an error, is not. The store lives in the server process's memory, holds at most
``capacity`` responses and drops the least recently used (stored, read or continued) first; a restart forgets them
all. It is read in the preparer's thread (a continuation's context) and written on the event loop (a finished
response), under one lock.
"""

from __future__ import annotations

import copy
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from specdec.server.protocol import APIError
from specdec.server.responses_request import InputItem, MessageItem, ResponsesRequest, parse_item

DEFAULT_CAPACITY = 1024
"""Responses a server keeps unless told otherwise (``--max-stored-responses``)."""
ITEM_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
"""The prefix of the ``id`` given to an input item of each type that came without one."""
MAX_PAGE = 100
"""The most input items one ``GET /v1/responses/{id}/input_items`` answers (``limit``: 1 to this, default 20)."""


@dataclass(frozen=True)
class Turn:
    """A Responses request's items: ``context`` (the stored response's it continues; none for a new conversation)
    and ``own`` (its ``input``'s)."""

    context: tuple[InputItem, ...]
    own: tuple[InputItem, ...]

    @property
    def items(self) -> tuple[InputItem, ...]:
        """The conversation the model is shown after ``instructions``."""
        return (*self.context, *self.own)


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: the ``response`` object as answered, its ``input_items`` (dicts, as listed) and its
    ``context`` (parsed)."""

    response: dict[str, Any]
    input_items: tuple[dict[str, Any], ...]
    context: tuple[InputItem, ...]


class ResponseStore:
    """At most ``capacity`` stored responses by id, least recently used dropped first (``capacity`` 0: nothing is
    stored, and a ``previous_response_id`` is a 400 that says so)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._stored: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._stored)

    def keeps(self, req: ResponsesRequest) -> bool:
        """Whether ``req``'s response will be stored (what its ``store`` field says)."""
        return req.store and self.capacity > 0

    def turn(self, req: ResponsesRequest) -> Turn:
        """``req``'s items, after the context of the response it continues; an unknown ``previous_response_id`` is
        OpenAI's 400 ``previous_response_not_found``, a bad item a 400 naming it."""
        return Turn(self._context(req.previous_response_id), tuple(req.items()))

    def _context(self, previous_response_id: str | None) -> tuple[InputItem, ...]:
        if previous_response_id is None:
            return ()
        if self.capacity == 0:
            raise APIError(400, "this server stores no responses (started with --max-stored-responses 0): send the "
                                "whole conversation in input instead of previous_response_id",
                           param="previous_response_id", code="previous_response_not_found")
        stored = self._get(previous_response_id)
        if stored is None:
            raise APIError(400, f"Previous response with id {previous_response_id!r} not found (it was never stored, "
                                f"was deleted, or was dropped: this server keeps the {self.capacity} most recently "
                                "used responses, in memory)", param="previous_response_id",
                           code="previous_response_not_found")
        return stored.context

    def add(self, response: dict[str, Any], turn: Turn) -> None:
        """Store ``response``, the answer to the request of ``turn``."""
        output = tuple(parse_item(item, f"output[{i}]") for i, item in enumerate(response["output"]))
        stored = StoredResponse(copy.deepcopy(response), tuple(_with_id(item) for item in turn.own),
                                (*turn.items, *output))
        with self._lock:
            self._stored[response["id"]] = stored
            self._stored.move_to_end(response["id"])
            while len(self._stored) > self.capacity:
                self._stored.popitem(last=False)

    def response(self, response_id: str) -> dict[str, Any]:
        """The stored response object (a 404 when there is none)."""
        return copy.deepcopy(self._found(response_id).response)

    def delete(self, response_id: str) -> dict[str, Any]:
        """Remove a stored response; OpenAI's answer to ``DELETE /v1/responses/{id}`` (a 404 when there is none).
        Responses that continued it keep their context."""
        with self._lock:
            if self._stored.pop(response_id, None) is None:
                raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def input_items(self, response_id: str, limit: int = 20, order: str = "desc", after: str | None = None
                    ) -> dict[str, Any]:
        """A page of a stored response's input items, OpenAI's list object: ``limit`` items (1 to
        :data:`MAX_PAGE`) in ``order`` (``asc``: as sent; ``desc``: last first), from the one after the item
        ``after``."""
        if not 1 <= limit <= MAX_PAGE:
            raise APIError(400, f"limit must be an integer from 1 to {MAX_PAGE}, got {limit}", param="limit")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
        items = list(self._found(response_id).input_items)
        if order == "desc":
            items.reverse()
        start = 0
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(400, f"after: no input item of response {response_id!r} has the id {after!r}",
                               param="after")
            start = ids.index(after) + 1
        page = copy.deepcopy(items[start:start + limit])
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(items)}

    def _get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._stored.get(response_id)
            if stored is not None:
                self._stored.move_to_end(response_id)
            return stored

    def _found(self, response_id: str) -> StoredResponse:
        stored = self._get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id {response_id!r} not found.", code="response_not_found")


def _with_id(item: InputItem) -> dict[str, Any]:
    """An input item as listed: with an ``id``, a message's text as one content part."""
    data = item.model_dump(by_alias=True, exclude_none=True)
    data.setdefault("id", f"{ITEM_PREFIXES[item.type]}_{uuid.uuid4().hex}")
    if isinstance(item, MessageItem) and isinstance(item.content, str):
        data["content"] = [{"type": "output_text" if item.role == "assistant" else "input_text",
                            "text": item.content}]
    return data
