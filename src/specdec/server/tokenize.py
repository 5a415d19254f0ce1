"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: a prompt or a conversation as the model's tokens (what a
completion or a chat request would feed it), and tokens as text. Clients count tokens with them.

``/tokenize`` takes ``{"prompt": TEXT}`` (``add_special_tokens`` default true, as a completion encodes it) or a chat's
``{"messages": [...]}`` with its rendering options and ``tools`` (``add_special_tokens`` default false: the template
writes them), and ``return_token_strs``; it answers ``{"count", "max_model_len", "tokens", "token_strs"}``.
``/detokenize`` takes ``{"tokens": [...]}`` and answers ``{"prompt": TEXT}``. Both take an optional ``model`` (the
served name).
"""

from __future__ import annotations

from pydantic import Field

from specdec.server.chat_request import ChatRendering
from specdec.server.protocol import StrictModel


class TokenizePrompt(StrictModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(ChatRendering):
    model: str | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


class Detokenize(StrictModel):
    model: str | None = None
    tokens: list[int] = Field(min_length=1)
