"""Anthropic's Messages API request (``POST /v1/messages``, which Anthropic's SDKs and Claude Code send, and
``POST /v1/messages/count_tokens``), read as the chat request it amounts to.

``system`` and ``messages`` become chat messages: a user turn's ``tool_result`` blocks become ``tool`` messages
(before the turn's text), an assistant turn's ``tool_use`` blocks its ``tool_calls`` (``input`` as the arguments'
JSON) and its ``thinking`` blocks its ``reasoning_content``. ``tools`` (``name``, ``description``, ``input_schema``)
become function tools; ``tool_choice`` ``auto``, ``any``, ``tool`` and ``none`` become ``"auto"``, ``"required"``, a
named function and ``"none"`` (``disable_parallel_tool_use``: ``parallel_tool_calls: false``); ``stop_sequences``
becomes ``stop``; ``output_config.format`` (a JSON schema) becomes ``response_format``; ``thinking`` becomes
``chat_template_kwargs: {"enable_thinking": ...}``, false for ``disabled`` and true otherwise (the switch of Qwen3's
and other hybrid models' templates) unless the request sets ``chat_template_kwargs`` itself, and its
``budget_tokens`` the thinking's budget (``thinking_token_budget``) where a reasoning parser is served;
``cache_control`` is accepted and has no effect (prefix caching is automatic).
The chat request's sampling extensions (:class:`~specdec.server.chat_request.ChatExtensions`) pass as they are.
Everything after that is the chat endpoint's, and an error in a chat field is reported under the Messages field it
came from (:data:`CHAT_FIELDS`).

Refused by name with a 400: images, documents and other blocks than text, tool_use, tool_result and thinking;
server tools (web search, code execution, ...).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from specdec.errors import short_repr
from specdec.server.chat_request import ChatExtensions, chat_error_as
from specdec.server.protocol import APIError, StrictModel, parse

CHAT_FIELDS = {"messages": "messages", "max_completion_tokens": "max_tokens", "stop": "stop_sequences",
               "response_format": "output_config.format",
               "tools": "tools", "tool_choice": "tool_choice", "temperature": "temperature", "top_p": "top_p",
               "model": "model", "stream": "stream", "parallel_tool_calls": "tool_choice.disable_parallel_tool_use"}
"""The chat request's fields and the Messages fields they come from (errors are named by the latter)."""


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class ToolUseBlock(StrictModel):
    """A call the assistant made (``id`` is what its ``tool_result`` answers)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ThinkingBlock(StrictModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


BLOCKS = {"user": {"text": TextBlock, "tool_result": ToolResultBlock},
          "assistant": {"text": TextBlock, "tool_use": ToolUseBlock, "thinking": ThinkingBlock}}
"""The content blocks each role may send."""


class Tool(StrictModel):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(StrictModel):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictModel):
    """``output_config``: ``format`` constrains the answer to a JSON schema; ``effort`` has no effect here."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class MessagesRequest(ChatExtensions):
    """``POST /v1/messages`` (``max_tokens`` is required there, not in ``count_tokens``)."""

    model: str | None = None
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None

    def chat_body(self, generate: bool = True, reasoning: bool = False) -> dict[str, Any]:
        """The chat request this one amounts to; ``generate``: a request to answer (``max_tokens`` required),
        not one to count; ``reasoning``: the server splits a reasoning model's thinking, so ``thinking``'s
        ``budget_tokens`` bounds it (``thinking_token_budget``; without a reasoning parser it has nothing to bound
        and is left out)."""
        body: dict[str, Any] = {"model": self.model, "messages": self.chat_messages(), "temperature": self.temperature,
                                "top_p": self.top_p, "stream": self.stream}
        body.update(self.extensions())
        if generate:
            if self.max_tokens is None:
                raise APIError(400, "max_tokens is required", param="max_tokens")
            body["max_completion_tokens"] = self.max_tokens
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        if self.tools:
            body["tools"] = [self._chat_tool(i, t) for i, t in enumerate(self.tools)]
        choice = self.tool_choice
        if choice is not None:
            if choice.type == "tool" and not choice.name:
                raise APIError(400, "tool_choice of type 'tool' needs the tool's name", param="tool_choice.name")
            body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                                   else {"any": "required"}.get(choice.type, choice.type))
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        if self.thinking is not None and self.chat_template_kwargs is None:
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
        budget = self.thinking.budget_tokens if self.thinking is not None and self.thinking.type == "enabled" else None
        if reasoning and budget is not None and self.thinking_token_budget is None:
            body["thinking_token_budget"] = budget
        if self.output_config is not None and self.output_config.format is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"schema": self.output_config.format.schema_}}
        return body

    def chat_messages(self) -> list[dict[str, Any]]:
        """``system`` and ``messages`` as chat messages."""
        system = self.system if isinstance(self.system, str) or self.system is None else "".join(
            b.text for b in self.system)
        out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if not self.messages:
            raise APIError(400, "messages is an empty list", param="messages")
        for i, raw in enumerate(self.messages):
            role = raw.get("role") if isinstance(raw, dict) else None
            if not isinstance(role, str) or role not in BLOCKS or set(raw) != {"role", "content"}:
                raise APIError(400, f"messages[{i}] must be {{\"role\": \"user\" or \"assistant\", \"content\": "
                                    f"...}}, got {short_repr(raw, 80)}", param=f"messages[{i}]")
            content = raw["content"]
            if isinstance(content, str):
                out.append({"role": role, "content": content})
                continue
            if not isinstance(content, list):
                raise APIError(400, f"messages[{i}].content must be a string or a list of content blocks",
                               param=f"messages[{i}].content")
            out += self._turn(i, role, [self._block(i, j, role, b) for j, b in enumerate(content)])
        return out

    @staticmethod
    def _block(i: int, j: int, role: str, raw: Any) -> StrictModel:
        kind = raw.get("type") if isinstance(raw, dict) else None
        where = f"messages[{i}].content[{j}]"
        if not isinstance(kind, str) or kind not in BLOCKS[role]:
            raise APIError(400, f"{where} must be a block of type {', '.join(BLOCKS[role])} in a {role} message "
                                f"(no images or documents), got {short_repr(raw, 60)}", param=where)
        try:
            return parse(BLOCKS[role][kind], raw)
        except APIError as exc:
            raise APIError(400, f"{where}: {exc.message}", param=where + (
                f".{exc.param}" if exc.param else "")) from None

    @staticmethod
    def _turn(i: int, role: str, blocks: list[StrictModel]) -> list[dict[str, Any]]:
        """One turn's chat messages: a user's tool results (each a tool message) before its text; an assistant's
        text with its calls and thinking."""
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        if role == "user":
            results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                       for b in blocks if isinstance(b, ToolResultBlock)]
            return results + ([{"role": "user", "content": text}] if text or not results else [])
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        reasoning = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
        if reasoning:
            message["reasoning_content"] = reasoning
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in blocks if isinstance(b, ToolUseBlock)]
        if calls:
            message["tool_calls"] = calls
        elif message["content"] is None:
            message["content"] = ""
        return [message]

    @staticmethod
    def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
        if tool.get("type", "custom") not in ("custom", None):
            raise APIError(400, f"tools[{i}] is of type {short_repr(tool.get('type'), 40)}: this server runs "
                                "custom tools only (no server tools such as web search or code execution)",
                           param=f"tools[{i}].type")
        try:
            checked: Tool = parse(Tool, tool)
        except APIError as exc:
            raise APIError(400, f"tools[{i}]: {exc.message}", param=f"tools[{i}]" + (
                f".{exc.param}" if exc.param else "")) from None
        function = {"name": checked.name, "parameters": checked.input_schema,
                    **({"description": checked.description} if checked.description else {})}
        return {"type": "function", "function": function}


def messages_error(exc: APIError) -> APIError:
    """A chat request's error, named by the Messages field it came from."""
    return chat_error_as(exc, CHAT_FIELDS, "messages")
