"""Reasoning models' thinking, apart from their answer: the server's ``--reasoning-parser`` (vLLM's flag) splits a
chat output into ``reasoning_content`` (what the model wrote between ``<think>`` and ``</think>``) and ``content``.

Two parsers, by how the model opens its thinking:

- ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ): the output starts inside the thinking (the template opens
  ``<think>``; a leading ``<think>`` the model writes itself is dropped) and ends it with ``</think>``; an output
  that never closes it is all reasoning.
- ``qwen3`` (Qwen3, whose thinking can be switched off): an output that opens with ``<think>`` thinks until
  ``</think>``; any other output is all content.

The answer after ``</think>`` then goes on to the tool-call parser, if any (:mod:`specdec.server.tool_calls`). A
constrained output (structured output, a forced tool call) is all content: the constraint applies from its first
token, so it holds no thinking.
"""

from __future__ import annotations

from typing import Any

OPEN, CLOSE = "<think>", "</think>"

PARSERS = {"deepseek_r1": True, "qwen3": False}
"""Reasoning parsers by name: whether the output starts inside the thinking."""


def _held(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may begin ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningSplit:
    """Splits one choice's output (``opens_inside``: :data:`PARSERS`' value). :meth:`split` reads a whole output;
    :meth:`feed` a stream's pieces, giving what to send of each part now (a tag's beginning is held until it is
    known)."""

    def __init__(self, opens_inside: bool) -> None:
        self.opens_inside = opens_inside
        self.text = ""
        self.sent = (0, 0)  # characters of reasoning and of content sent

    def split(self, text: str, final: bool = True) -> tuple[str, str]:
        """``(reasoning, content)`` of ``text``; not ``final``: of a partial output, holding back what may still
        turn out a tag, so that each part is a prefix of the whole output's."""
        start = text.lstrip()
        if not final and OPEN.startswith(start) and len(start) < len(OPEN):
            return "", ""
        if start.startswith(OPEN):
            body = start[len(OPEN):]
        elif self.opens_inside:
            body = text
        else:
            return "", text
        end = body.find(CLOSE)
        if end >= 0:
            return body[:end], body[end + len(CLOSE):]
        return body[:len(body) - (0 if final else _held(body, CLOSE))], ""

    def message(self, text: str) -> tuple[str | None, str]:
        """A whole output's reasoning (None where it has none) and content."""
        reasoning, content = self.split(text)
        return reasoning or None, content

    def feed(self, piece: str, final: bool) -> tuple[str, str]:
        """The reasoning and the content to send for a stream's next ``piece`` (``final``: the output ends)."""
        self.text += piece
        reasoning, content = self.split(self.text, final)
        sent, self.sent = self.sent, (max(self.sent[0], len(reasoning)), max(self.sent[1], len(content)))
        return reasoning[sent[0]:], content[sent[1]:]


def with_reasoning(fields: dict[str, Any], reasoning: str | None) -> dict[str, Any]:
    """A message or delta with ``reasoning_content`` first, where there is any."""
    return {"reasoning_content": reasoning, **fields} if reasoning else fields
