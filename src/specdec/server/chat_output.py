"""A chat request's choices as OpenAI's messages: each choice's text split into its reasoning and its answer
(:mod:`specdec.reasoning`, where the model's outputs think) and the answer read as content or tool calls
(:mod:`specdec.server.tool_calls`). The chat endpoint, the Responses API and the Messages API shape their outputs
with it."""

from __future__ import annotations

from typing import Any

from specdec.reasoning import ReasoningSplit
from specdec.server.chat_request import ChatRequest
from specdec.server.tool_calls import ToolOutput
from specdec.tools import ToolParser


class ChatOutputs:
    """The ``req.n`` choices of ``req``; ``parser`` reads ``"auto"``'s calls; ``thinks``: whether the outputs
    begin in the thinking (:meth:`specdec.llm.LLM.thinking`), None where no reasoning parser is served. One
    instance per request: a stream's choices keep what they have seen."""

    def __init__(self, req: ChatRequest, parser: ToolParser | None, thinks: bool | None) -> None:
        self.tools = [ToolOutput(req.tool_choice_name(), parser, req.parallel_tool_calls) for _ in range(req.n)]
        self.thinking = None if thinks is None else [ReasoningSplit(thinks) for _ in range(req.n)]

    def delta(self, index: int, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """Choice ``index``'s delta for a new piece of text (``reasoning_content`` first, where there is any) and
        the finish reason to send with it."""
        reasoning, text = ("", text) if self.thinking is None else self.thinking[index].feed(text, finish is not None)
        delta, finish = self.tools[index].delta(text, finish)
        return with_reasoning(delta, reasoning), finish

    def message(self, index: int, text: str, finish: str | None) -> dict[str, Any]:
        """Choice ``index``'s whole ``message`` and ``finish_reason``."""
        if self.thinking is None:
            return self.tools[index].message(text, finish)
        reasoning, text = self.thinking[index].message(text)
        shaped = self.tools[index].message(text, finish)
        if reasoning is not None and not shaped["message"]["content"]:
            shaped["message"]["content"] = None  # thinking alone: no answer
        return {**shaped, "message": with_reasoning(shaped["message"], reasoning)}


def with_reasoning(fields: dict[str, Any], reasoning: str | None) -> dict[str, Any]:
    """A message or delta with ``reasoning_content`` first, where there is any."""
    return {"reasoning_content": reasoning, **fields} if reasoning else fields
