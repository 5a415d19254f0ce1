"""Reasoning models' thinking, apart from their answer: ``reasoning_parser`` (vLLM's name, an ``LLM`` argument and the
server's ``--reasoning-parser``) says where a model's output thinks (between ``<think>`` and ``</think>``) and where it
answers. Two parsers, by how the model opens its thinking:

- ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ): the output starts inside the thinking (the template opens
  ``<think>``; a leading ``<think>`` the model writes itself is dropped) and ends it with ``</think>``; an output
  that never closes it is all reasoning.
- ``qwen3`` (Qwen3, whose thinking can be switched off): an output that opens with ``<think>`` thinks until
  ``</think>``; any other output is all content.

A prompt that closes the thinking itself (its last ``</think>`` after its last ``<think>``: a template with the
thinking switched off, Qwen3's ``enable_thinking: false``) leaves no thinking to the output, which is all answer
(:func:`thinking_closed`), as vLLM reads the prompt.

Two things read it: the server splits a chat output into ``reasoning_content`` and ``content``
(:class:`ReasoningSplit`; the answer then goes on to the tool-call parser, if any), and a constrained request's
constraint holds for the answer only, the thinking before it being free (:mod:`specdec.structured.thinking`).
"""

from __future__ import annotations

from specdec.errors import SpecDecError

OPEN, CLOSE = "<think>", "</think>"

PARSERS = {"deepseek_r1": True, "qwen3": False}
"""Reasoning parsers by name: whether the output starts inside the thinking."""


def thinking_closed(prompt: str) -> bool:
    """Whether ``prompt`` (its text with special tokens) closes the thinking: its last ``</think>`` comes after its
    last ``<think>``, so the output is all answer."""
    return prompt.rfind(CLOSE) > prompt.rfind(OPEN)


def output_thinking(parser: str | None, prompt: str) -> bool | None:
    """How an output of ``parser`` after ``prompt`` thinks: None where it does not (no parser, or the prompt closed
    the thinking: all answer), True where it starts inside the thinking, False where it may open it (what
    :class:`ReasoningSplit`, as a bool, and :func:`~specdec.structured.thinking.after_thinking` take)."""
    if parser is None or thinking_closed(prompt):
        return None
    return PARSERS[parser]


def check_reasoning_parser(name: object) -> None:
    """A :class:`SpecDecError` unless ``name`` is None or a name of :data:`PARSERS`."""
    if name is not None and name not in PARSERS:
        raise SpecDecError(f"unknown reasoning parser {name!r}: specdec has {', '.join(sorted(PARSERS))}")


def _held(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may begin ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningSplit:
    """Splits one choice's output (``opens_inside``: :data:`PARSERS`' value). :meth:`split` reads a whole output;
    :meth:`feed` a stream's pieces, giving what to send of each part now (a tag's beginning is held until it is
    known). A stream is read once: each piece costs what it holds, not what came before it."""

    def __init__(self, opens_inside: bool) -> None:
        self.opens_inside = opens_inside
        self.text = ""
        self.body: int | None = None  # where the thinking starts in the text (-1: none), once known
        self.close = -1  # where ``CLOSE`` starts, once found
        self.searched = 0  # no ``CLOSE`` starts before this
        self.sent = [0, 0]  # where the reasoning and the content sent so far end, in the text

    def _body(self, text: str, final: bool) -> int | None:
        """Where the thinking starts in ``text`` (-1: it has none; None: not known yet)."""
        start = text.lstrip()
        if not final and OPEN.startswith(start) and len(start) < len(OPEN):
            return None
        if start.startswith(OPEN):
            return len(text) - len(start) + len(OPEN)
        return 0 if self.opens_inside else -1

    def split(self, text: str, final: bool = True) -> tuple[str, str]:
        """``(reasoning, content)`` of ``text``; not ``final``: of a partial output, holding back what may still
        turn out a tag, so that each part is a prefix of the whole output's."""
        body = self._body(text, final)
        if body is None:
            return "", ""
        if body < 0:
            return "", text
        end = text.find(CLOSE, body)
        if end >= 0:
            return text[body:end], text[end + len(CLOSE):]
        return text[body:len(text) - (0 if final else _held(text[body:], CLOSE))], ""

    def message(self, text: str) -> tuple[str | None, str]:
        """A whole output's reasoning (None where it has none) and content."""
        reasoning, content = self.split(text)
        return reasoning or None, content

    def feed(self, piece: str, final: bool) -> tuple[str, str]:
        """The reasoning and the content to send for a stream's next ``piece`` (``final``: the output ends)."""
        self.text += piece
        text = self.text
        if self.body is None:
            self.body = self._body(text, final)
            if self.body is None:
                return "", ""
            self.sent = [max(self.body, 0), 0]  # in thinking, content starts after CLOSE, once found
        if self.body < 0:
            content, self.sent[1] = text[self.sent[1]:], len(text)
            return "", content
        if self.close < 0:
            self.close = text.find(CLOSE, max(self.body, self.searched))
            self.searched = max(self.body, len(text) - len(CLOSE) + 1)
            if self.close >= 0:
                self.sent[1] = self.close + len(CLOSE)
        if self.close >= 0:
            end = self.close
        else:
            tail = max(self.body, len(text) - len(CLOSE))
            end = len(text) - (0 if final else _held(text[tail:], CLOSE))
        reasoning = text[self.sent[0]:end] if end > self.sent[0] else ""
        self.sent[0] = max(self.sent[0], end)
        content = ""
        if self.close >= 0:
            content, self.sent[1] = text[self.sent[1]:], len(text)
        return reasoning, content

