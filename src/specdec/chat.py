"""Chat conversations as prompts: OpenAI's messages, rendered by the tokenizer's chat template (or a given one)
into the text the model continues, tokenized without adding special tokens (the template writes them).

Used by :meth:`specdec.llm.LLM.chat` (vLLM's ``LLM.chat``) and by the server's ``/v1/chat/completions``.
"""

from __future__ import annotations

from typing import Any

from specdec.errors import SpecDecError
from specdec.tools import check_tools, tool_messages

ROLES = ("system", "user", "assistant", "developer", "tool")


def _text(content: Any) -> str | None:
    """A message's content as a string: a string, or a list of ``{"type": "text", "text": ...}`` parts joined;
    None where it is neither."""
    if isinstance(content, (list, tuple)) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    return content if isinstance(content, str) else None


def _calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` (OpenAI's ``[{"id", "type": "function", "function": {"name",
    "arguments"}}]``, arguments as JSON text) checked."""
    if not isinstance(calls, (list, tuple)) or not all(
            isinstance(c, dict) and c.get("type", "function") == "function" and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str) and isinstance(c["function"].get("arguments", ""), str)
            and isinstance(c.get("id", ""), str) for c in calls):
        raise SpecDecError(f"{where}'s tool_calls must be a list of {{\"id\", \"type\": \"function\", \"function\": "
                           f"{{\"name\", \"arguments\"}}}} with string names and arguments, got {calls!r:.80}")
    return [dict(c) for c in calls]


def conversation_of(messages: Any, where: str = "messages") -> list[dict[str, Any]]:
    """``messages`` (a list of ``{"role": ..., "content": ...}``; content a string or a list of
    ``{"type": "text", "text": ...}`` parts, joined) as ``[{"role", "content", ...}]`` with string contents, or a
    :class:`SpecDecError` naming the first bad message (``where[i]``). An assistant message may carry
    ``tool_calls`` (then its content may be null) and ``reasoning_content``, a ``tool`` message the ``tool_call_id``
    it answers; a message's ``name`` is kept."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise SpecDecError(f"{where} must be a non-empty list of messages, got {messages!r:.80}")
    conversation = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise SpecDecError(f"{where}[{i}] must be a dict with a 'role' in {ROLES} and a 'content', "
                               f"got {message!r:.80}")
        role, content = message["role"], message.get("content")
        turn: dict[str, Any] = {"role": role}
        if role == "assistant" and message.get("tool_calls") is not None:
            turn["tool_calls"] = _calls(message["tool_calls"], f"{where}[{i}]")
            content = "" if content is None else content
        text = _text(content)
        if text is None:
            raise SpecDecError(f"{where}[{i}]'s content must be a string or a list of text parts, got "
                               f"{content!r:.80}")
        turn["content"] = text
        for key in ("name", "tool_call_id", "reasoning_content"):
            if message.get(key) is not None:
                if not isinstance(message[key], str):
                    raise SpecDecError(f"{where}[{i}]'s {key} must be a string, got {message[key]!r:.80}")
                turn[key] = message[key]
        conversation.append(turn)
    return conversation


def has_template(tokenizer, chat_template: str | None) -> bool:
    """Whether a conversation can be rendered: a tokenizer, and a template given or its own."""
    return tokenizer is not None and (chat_template is not None or bool(getattr(tokenizer, "chat_template", None)))


RENDER_ARGUMENTS = frozenset({"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                              "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                              "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
"""transformers' ``apply_chat_template`` arguments: not template variables, so not ``template_kwargs`` keys."""


def render(tokenizer, conversation: list[dict[str, Any]], chat_template: str | None = None,
           add_generation_prompt: bool = True, continue_final_message: bool = False,
           template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None) -> str:
    """The text of ``conversation`` under ``chat_template`` (None: the tokenizer's own), offering ``tools``
    (:func:`specdec.tools.check_tools`'s; earlier calls' arguments are given to the template as objects), with the
    assistant's
    turn opened when ``add_generation_prompt``, or its last message left open to be continued when
    ``continue_final_message`` (vLLM's names); ``template_kwargs`` are more variables for the template (vLLM's
    ``chat_template_kwargs``, e.g. ``{"enable_thinking": False}``). Bad arguments, and a template that fails (its
    own ``raise_exception``, a bug), are a :class:`SpecDecError` with the reason."""
    for name, flag in (("add_generation_prompt", add_generation_prompt),
                       ("continue_final_message", continue_final_message)):
        if not isinstance(flag, bool):
            raise SpecDecError(f"{name} must be true or false, got {flag!r:.80}")
    if add_generation_prompt and continue_final_message:
        raise SpecDecError("continue_final_message continues the last message, and add_generation_prompt opens a new "
                           "one: set add_generation_prompt to false")
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise SpecDecError(f"continue_final_message continues the last message, which is the "
                           f"{conversation[-1]['role']}'s: it must be the assistant's")
    template_kwargs = {} if template_kwargs is None else template_kwargs
    if not isinstance(template_kwargs, dict) or not all(isinstance(k, str) for k in template_kwargs):
        raise SpecDecError(f"chat_template_kwargs must be an object of template variables, got {template_kwargs!r:.80}")
    taken = sorted(RENDER_ARGUMENTS & set(template_kwargs))
    if taken:
        raise SpecDecError(f"chat_template_kwargs cannot set {taken[0]!r}: it is an argument of the rendering, not a "
                           "template variable")
    try:
        return tokenizer.apply_chat_template(tool_messages(conversation), tools=tools, chat_template=chat_template,
                                             tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **template_kwargs)
    except Exception as exc:
        raise SpecDecError(f"the chat template could not render these messages: {exc}") from None


def chat_prompt(tokenizer, text: str) -> dict[str, Any]:
    """A rendered conversation as a prompt: its text and its tokens, special tokens not added again."""
    return {"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False)["input_ids"]}


def chat_prompts(tokenizer, model_name: str, messages: Any, chat_template: str | None, add_generation_prompt: bool,
                 continue_final_message: bool, chat_template_kwargs: dict[str, Any] | None,
                 tools: Any = None) -> list[dict[str, Any]]:
    """``LLM.chat``'s prompts: one conversation (a list of messages) or a list of them, each rendered by
    ``chat_template`` (None: the tokenizer's own) with ``tools`` offered, and tokenized (:func:`render`,
    :func:`chat_prompt`). A model without a template or a tokenizer, or a bad message or tool, is a
    :class:`SpecDecError` naming ``model_name``."""
    tools = check_tools(tools)
    if not isinstance(chat_template, (str, type(None))):
        raise SpecDecError(f"chat_template must be a string or None, got {type(chat_template).__name__}")
    if not has_template(tokenizer, chat_template):
        raise SpecDecError(f"model {model_name!r} has no chat template: pass chat_template (a Jinja template "
                           "string)" if tokenizer is not None else f"model {model_name!r} has no tokenizer to "
                           "render a chat")
    many = isinstance(messages, (list, tuple)) and bool(messages) and isinstance(messages[0], (list, tuple))
    conversations = [conversation_of(c, f"messages[{i}]") for i, c in enumerate(messages)] if many else [
        conversation_of(messages)]
    return [chat_prompt(tokenizer, render(tokenizer, c, chat_template, add_generation_prompt, continue_final_message,
                                          chat_template_kwargs, tools)) for c in conversations]
