"""The Responses API's request (``POST /v1/responses``, OpenAI's newer endpoint, which its Agents SDK and Codex
send), read as the chat request it amounts to.

``input`` (a string, or a list of items: messages, earlier ``function_call`` items and their
``function_call_output``, and ``reasoning`` items as clients echo them back) and ``instructions`` become chat
messages; the flat function ``tools`` become chat tools; ``text.format`` becomes ``response_format``;
``max_output_tokens`` becomes ``max_completion_tokens``; the chat request's sampling extensions
(:class:`~specdec.server.chat_request.ChatExtensions`: ``top_k``, ``seed``, ``structured_outputs``, ..., and
``stop``) pass as they are. Everything after
that is the chat endpoint's: the same checks, tool calling, reasoning split and constraints
(:mod:`specdec.server.chat_request`), and an error in a chat field is reported under the Responses field it came
from (:data:`CHAT_FIELDS`).

``previous_response_id`` continues a stored response (:mod:`specdec.server.response_store`): its context and
output go before ``input`` (:meth:`ResponsesRequest.chat_body`'s ``items``).

What the server does not do is refused by name with a 400: ``background`` responses, built-in tools (web search, file
search, code interpreter, ...), images and files in the input, ``truncation: "auto"``, ``top_logprobs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field

from specdec.errors import short_repr
from specdec.server.chat_request import ChatExtensions, chat_error_as
from specdec.server.protocol import APIError, StrictModel, parse

CHAT_FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
               "tools": "tools", "tool_choice": "tool_choice", "parallel_tool_calls": "parallel_tool_calls",
               "temperature": "temperature", "top_p": "top_p", "model": "model", "stream": "stream"}
"""The chat request's fields and the Responses fields they come from (errors are named by the latter)."""


class InputText(StrictModel):
    """A text part of an input message (``output_text`` in an assistant message a client echoes back)."""

    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(StrictModel):
    """A call the model made earlier (``call_id`` is what its output answers)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningPart(StrictModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(StrictModel):
    """A reasoning output a client echoes back: its text becomes the next assistant message's ``reasoning_content``
    (templates such as Qwen3's render it, or leave it out of earlier turns)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    def text(self) -> str:
        return "".join(p.text for p in self.content or self.summary)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEM_TYPES: dict[str, type[InputItem]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                          "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(StrictModel):
    """``text.format``: plain text, any JSON object, or a named JSON schema (``strict`` is always honoured)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(ChatExtensions):
    """``POST /v1/responses``. ``max_output_tokens`` defaults to what is left of ``max_model_len``."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    truncation: Literal["disabled"] | None = None
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    previous_response_id: str | None = None
    background: Literal[False] | None = None
    top_logprobs: Literal[0] | None = None
    reasoning: dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None
    stop: Any = None

    def items(self) -> list[InputItem]:
        """``input`` as items (a string is one user message); a bad item is a 400 naming it."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        if not self.input:
            raise APIError(400, "input is an empty list", param="input")
        return [parse_item(raw, f"input[{i}]") for i, raw in enumerate(self.input)]

    def chat_body(self, items: Sequence[InputItem] | None = None) -> dict[str, Any]:
        """The chat request this one amounts to (a dict for :class:`~specdec.server.chat_request.ChatRequest`):
        ``instructions``, then ``items`` (the conversation's: a stored response's context before this request's
        own, :class:`specdec.server.response_store.Turn`; None: ``input``'s)."""
        if self.reasoning not in (None, {}) and set(self.reasoning) - {"effort", "summary"}:
            raise APIError(400, f"reasoning takes effort and summary, got {sorted(self.reasoning)}",
                           param="reasoning")
        body: dict[str, Any] = {"model": self.model, "messages": self.messages(items),
                                "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream,
                                "parallel_tool_calls": self.parallel_tool_calls}
        body.update({**self.extensions(), **({"stop": self.stop} if self.stop is not None else {})})
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [self._chat_tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = self._chat_tool_choice()
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise APIError(400, "text.format of type 'json_schema' needs a schema", param="text.format.schema")
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_}}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        return body

    def messages(self, items: Sequence[InputItem] | None = None) -> list[dict[str, Any]]:
        """The chat messages of ``instructions`` and ``items`` (None: ``input``'s): consecutive calls join one
        assistant message (after its text, if it had any), a reasoning item's text goes with the next assistant
        message."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        reasoning = ""
        for item in self.items() if items is None else items:
            if isinstance(item, ReasoningItem):
                reasoning += item.text()
                continue
            if isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
                continue
            if isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                    continue
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                messages.append({"role": item.role, "content": item.text()})
            if messages[-1]["role"] == "assistant" and reasoning:
                messages[-1]["reasoning_content"], reasoning = reasoning, ""
        return messages

    @staticmethod
    def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
        if tool.get("type") != "function":
            raise APIError(400, f"tools[{i}] is of type {short_repr(tool.get('type'), 40)}: this server runs function "
                                "tools only (no built-in tools such as web or file search)", param=f"tools[{i}].type")
        try:
            checked = FunctionTool.model_validate(tool)
        except ValueError:
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"name\": ..., \"parameters\"?: "
                                "{...}, \"description\"?: ...}", param=f"tools[{i}]") from None
        function = {"name": checked.name, **({"description": checked.description} if checked.description else {}),
                    **({"parameters": checked.parameters} if checked.parameters is not None else {})}
        return {"type": "function", "function": function}

    def _chat_tool_choice(self) -> str | dict[str, Any]:
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        if isinstance(choice, str):
            return choice
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": "
                            "...}", param="tool_choice")


def parse_item(raw: Any, where: str) -> InputItem:
    """One input item (an output item of an earlier response reads as one too); a bad one is a 400 naming it
    (``where``: ``input[3]``)."""
    kind = raw.get("type", "message") if isinstance(raw, dict) else None
    if not isinstance(kind, str) or kind not in ITEM_TYPES:
        raise APIError(400, f"{where} must be an item of type {', '.join(ITEM_TYPES)} (no images, files or built-in "
                            f"tool calls), got {short_repr(raw, 60)}", param=where)
    try:
        return parse(ITEM_TYPES[kind], raw)
    except APIError as exc:
        raise APIError(400, f"{where}: {exc.message}", param=where + (f".{exc.param}" if exc.param else "")) from None


def responses_error(exc: APIError) -> APIError:
    """A chat request's error, named by the Responses field it came from."""
    return chat_error_as(exc, CHAT_FIELDS, "input")
