"""The chat endpoint's request: OpenAI's messages (with earlier tool calls and their results), vLLM's rendering
options, and the tools with the tool choice (:mod:`specdec.tools`), on top of the fields both endpoints share
(:class:`~specdec.server.protocol.SamplingFields`). Other APIs' requests read as the chat request they amount to
(the Responses API, Anthropic's Messages API) carry its sampling extensions (:class:`ChatExtensions`) and have its
errors named by their own fields (:func:`chat_error_as`)."""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import field_validator, model_validator

from specdec.chat import conversation_of
from specdec.errors import SpecDecError
from specdec.server.protocol import APIError, SamplingFields, StrictModel, check_logprobs
from specdec.structured import StructuredOutputsParams
from specdec.tools import FREE_CHOICES, check_tool_choice, check_tools
from specdec.tools import schema as tool_schema


class ContentPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str
    arguments: str


class ToolCallMessage(StrictModel):
    """One of an assistant message's ``tool_calls``: a call the model made earlier in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    """A message; an assistant's may carry ``tool_calls`` (its content then may be null), a ``tool`` message the
    ``tool_call_id`` whose result it is, and an assistant's the ``reasoning_content`` a reasoning parser returned
    (templates such as Qwen3's render it). ``refusal`` (what OpenAI's client echoes back) is accepted as null."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    refusal: None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is missing (only an assistant message with tool_calls may leave it out)")
        return self


class ChatRendering(StrictModel):
    """What renders a conversation into a prompt: the messages, the tools and vLLM's rendering options."""

    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as :func:`specdec.chat.conversation_of` checks and returns them, or a 400."""
        if not self.messages:
            raise APIError(400, "messages is an empty list", param="messages")
        try:
            return conversation_of([m.model_dump(exclude_none=True) for m in self.messages])
        except SpecDecError as exc:
            raise APIError(400, str(exc), param="messages") from None

    def checked_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` as :func:`specdec.tools.check_tools` returns them (None: none given), or a 400."""
        try:
            return check_tools(self.tools)
        except SpecDecError as exc:
            raise APIError(400, str(exc), param="tools") from None


class ChatRequest(SamplingFields, ChatRendering):
    """``POST /v1/chat/completions``; ``max_tokens`` (or ``max_completion_tokens``) defaults to what is
    left of ``max_model_len`` after the prompt."""

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    unsupported_here: ClassVar[dict[str, tuple[Any, ...]]] = {"echo": (False,)}

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None) -> int | None:
        return check_logprobs(value, "top_logprobs")

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, f"top_logprobs is {self.top_logprobs} but logprobs is not true: set logprobs to "
                                "true to get log probabilities", param="top_logprobs")
        return self

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_choice_name(self) -> str:
        """:func:`specdec.tools.check_tool_choice` of ``tool_choice``, or a 400."""
        try:
            return check_tool_choice(self.tool_choice, self.checked_tools())
        except SpecDecError as exc:
            raise APIError(400, str(exc), param="tool_choice") from None

    def constraint_source(self) -> str | None:
        return "tools" if self.tool_choice_name() not in FREE_CHOICES else super().constraint_source()

    def constraint(self) -> StructuredOutputsParams | None:
        """A ``tool_choice`` of ``"required"`` or a function constrains the output to calls
        (:func:`specdec.tools.schema`), and then the request takes no other constraint; a ``structured_outputs``
        holding options alone (``disable_any_whitespace``) applies them, as vLLM merges them."""
        forced = tool_schema(self.tool_choice_name(), self.checked_tools(), self.parallel_tool_calls)
        if forced is None:
            return super().constraint()
        given = self.constraint_fields()
        if given:
            raise APIError(400, f"tool_choice {self.tool_choice_name()!r} constrains the output to tool calls, so "
                                f"the request cannot also set {given[0]}", param="tool_choice")
        try:
            return StructuredOutputsParams.from_dict({**(self.structured_outputs or {}), "json": forced})
        except SpecDecError as exc:
            raise APIError(400, str(exc), param="structured_outputs" if self.structured_outputs else "tools") from None


class ChatExtensions(StrictModel):
    """The chat request's sampling and rendering extensions (vLLM's) that another API's request may send too
    (``extra_body`` in its client); they go to the chat request as they are and are checked there."""

    top_k: Any = None
    min_p: Any = None
    seed: Any = None
    stop_token_ids: Any = None
    ignore_eos: Any = None
    min_tokens: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    bad_words: Any = None
    skip_special_tokens: Any = None
    structured_outputs: Any = None
    chat_template_kwargs: Any = None
    thinking_token_budget: Any = None

    def extensions(self) -> dict[str, Any]:
        """The extensions sent, as chat fields."""
        return {name: getattr(self, name) for name in ChatExtensions.model_fields if getattr(self, name) is not None}


SAID = {"max_completion_tokens": ("max_tokens",), "response_format": ("structured_outputs",)}
"""Other names the chat request's messages give a field (its older name, the constraint it becomes)."""


def chat_error_as(exc: APIError, fields: dict[str, str], conversation: str) -> APIError:
    """A chat request's error as another API names its fields (``fields``: chat field -> that API's); any message's
    error is ``conversation``'s, without an index (system prompts, merged calls and split tool results move them)."""
    base = re.match(r"[a-z_]*", exc.param or "").group(0)
    target = fields.get(base)
    if target is None or target == base and base != "messages":
        return exc
    if base == "messages":
        return APIError(exc.status, re.sub(r"^messages(\[\d+\])?", conversation, exc.message), exc.type,
                        conversation, exc.code)
    said = "|".join((base, *SAID.get(base, ())))
    message = re.sub(rf"(?<![\w.])({said})(?![\w])", target, exc.message)
    return APIError(exc.status, message, exc.type, target + exc.param[len(base):], exc.code)
