"""Chat conversations as prompts: OpenAI's messages, rendered by the tokenizer's chat template (or a given one)
into the text the model continues, tokenized without adding special tokens (the template writes them).

Used by :meth:`specdec.llm.LLM.chat` (vLLM's ``LLM.chat``) and by the server's ``/v1/chat/completions``.
"""

from __future__ import annotations

from typing import Any

from specdec.errors import SpecDecError

ROLES = ("system", "user", "assistant", "developer")


def conversation_of(messages: Any, where: str = "messages") -> list[dict[str, str]]:
    """``messages`` (a list of ``{"role": ..., "content": ...}``; content a string or a list of
    ``{"type": "text", "text": ...}`` parts, joined) as ``[{"role", "content"}]`` with string contents, or a
    :class:`SpecDecError` naming the first bad message (``where[i]``)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise SpecDecError(f"{where} must be a non-empty list of messages, got {messages!r:.80}")
    conversation = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise SpecDecError(f"{where}[{i}] must be a dict with a 'role' in {ROLES} and a 'content', "
                               f"got {message!r:.80}")
        content = message.get("content")
        if isinstance(content, (list, tuple)) and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise SpecDecError(f"{where}[{i}]'s content must be a string or a list of text parts, got "
                               f"{content!r:.80}")
        conversation.append({"role": message["role"], "content": content})
    return conversation


def has_template(tokenizer, chat_template: str | None) -> bool:
    """Whether a conversation can be rendered: a tokenizer, and a template given or its own."""
    return tokenizer is not None and (chat_template is not None or bool(getattr(tokenizer, "chat_template", None)))


def render(tokenizer, conversation: list[dict[str, str]], chat_template: str | None = None,
           add_generation_prompt: bool = True) -> str:
    """The text of ``conversation`` under ``chat_template`` (None: the tokenizer's own), with the assistant's
    turn opened when ``add_generation_prompt``; a template that fails (its own ``raise_exception``, a bug) is a
    :class:`SpecDecError` with its message."""
    try:
        return tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as exc:
        raise SpecDecError(f"the chat template could not render these messages: {exc}") from None


def chat_prompt(tokenizer, text: str) -> dict[str, Any]:
    """A rendered conversation as a prompt: its text and its tokens, special tokens not added again."""
    return {"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False)["input_ids"]}
