"""An answer built as a list of items from a chat's deltas, what the Responses API's output items and the Messages
API's content blocks share: the thinking and the answer's text each extend an item of their kind while it is the
open one (a new item opens otherwise), each tool call opens an item at its first delta (the one with its ``id``) and
its argument deltas extend it; one item is open at a time, and opening one closes the one before.

A subclass says how its API writes this: the items it opens (:meth:`OutputItems._text_item`,
:meth:`OutputItems._call_item`) and the events of each step (:meth:`OutputItems._started`,
:meth:`OutputItems._extended`, :meth:`OutputItems._stopped`)."""

from __future__ import annotations

from typing import Any


class OutputItems:
    """The items of one answer, the last one open while streaming; ``REASONING`` and ``CONTENT``: the item types of
    the thinking and of the answer's text."""

    REASONING: str
    CONTENT: str

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open = False
        self.calls: dict[int, int] = {}  # a chat tool call's index -> its item's index

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat delta (a whole message is one delta too, its calls indexed)."""
        events = []
        for kind, text in ((self.REASONING, delta.get("reasoning_content")), (self.CONTENT, delta.get("content"))):
            if text:
                if not (self.open and self.items[-1]["type"] == kind):
                    events += self._open(self._text_item(kind))
                events += self._extended(len(self.items) - 1, text)
        for call in delta.get("tool_calls") or ():
            index = call.get("index", len(self.calls))
            if "id" in call:  # a call's first delta
                events += self._open(self._call_item(call))
                self.calls[index] = len(self.items) - 1
            arguments = call["function"].get("arguments") or ""
            if arguments:
                events += self._extended(self.calls[index], arguments)
        return events

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.items.append(item)
        self.open = True
        return events + self._started(len(self.items) - 1)

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        """The events of the open item's end (``status``: completed, or incomplete where the output was cut)."""
        if not self.open:
            return []
        self.open = False
        return self._stopped(len(self.items) - 1, status)

    # ------------------------------------------------------------------ the API's
    def _text_item(self, kind: str) -> dict[str, Any]:
        """A new, empty item of ``kind`` (:data:`REASONING` or :data:`CONTENT`)."""
        raise NotImplementedError

    def _call_item(self, call: dict[str, Any]) -> dict[str, Any]:
        """A new item of a tool call, from its first chat delta (no arguments yet)."""
        raise NotImplementedError

    def _started(self, index: int) -> list[dict[str, Any]]:
        """The events of item ``index`` just opened."""
        raise NotImplementedError

    def _extended(self, index: int, text: str) -> list[dict[str, Any]]:
        """Add ``text`` to item ``index`` (its text, or its call's arguments); the events that say so."""
        raise NotImplementedError

    def _stopped(self, index: int, status: str) -> list[dict[str, Any]]:
        """The events of item ``index`` just closed."""
        raise NotImplementedError
