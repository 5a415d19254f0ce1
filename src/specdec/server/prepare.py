"""From a request body to validated, encoded prompts: all a handler does before it submits.

:meth:`Preparer.completion` and :meth:`Preparer.chat` run in the preparer's own thread (never on
the event loop), so that a large body, a long prompt or a slow chat template delays no other
client: the JSON is parsed and checked, the request validated, its size bounded before any
tokenization, the prompt rendered and tokenized, and the sampling parameters checked against the
model (the Python API's own checks, :meth:`~specdec.llm.LLM.check_params`). Every problem is an
:class:`~specdec.server.protocol.APIError` in OpenAI's shape.

Limits (each refusal is a 400 that states its limit):

- the body: UTF-8 JSON, integers of at most 4,300 digits, nested at most :data:`MAX_JSON_DEPTH`
  levels, no lone surrogate in any string or field name, at most ``max_sequences * max_model_len
  +`` :data:`JSON_VALUES_SLACK` values (counted as commas, before parsing: the token ids of the
  largest request, and room for the other fields);
- the sequences of one request (prompts × ``n``): at most ``max_num_seqs + max_queue_len``;
- a text prompt (or a chat's message texts, earlier calls' arguments and the tools' JSON together): at most
  ``max_prompt_bytes`` UTF-8 bytes,
  :data:`PROMPT_BYTES_PER_TOKEN` per token of ``max_model_len`` unless set; a token-id prompt:
  fewer than ``max_model_len`` ids;
- prompt + ``max_tokens`` at most ``max_model_len`` (as vLLM; a chat's default ``max_tokens`` is
  what is left of it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from specdec.chat import chat_prompt, has_template, render
from specdec.errors import SpecDecError
from specdec.llm import LLM
from specdec.server.chat_request import ChatRendering, ChatRequest
from specdec.server.messages_request import MessagesRequest, messages_error
from specdec.server.protocol import APIError, CompletionRequest, SamplingFields, parse
from specdec.server.response_store import ResponseStore, Turn
from specdec.server.responses_request import ResponsesRequest, responses_error
from specdec.server.tokenize import Detokenize, TokenizeChat, TokenizePrompt
from specdec.tools import ToolParser

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects accepted in a request body."""
JSON_VALUES_SLACK = 4096
"""Values a body may have beyond the token ids of its prompts."""
PROMPT_BYTES_PER_TOKEN = 32
"""The default text prompt limit is this many UTF-8 bytes per token of ``max_model_len``."""

NO_TEMPLATE = ("model {name!r} has no chat template: start the server with --chat-template FILE (a Jinja "
               "template that renders 'messages'), or use /v1/completions")


@dataclass
class Prepared:
    """A validated request and its encoded prompts ``(text or None, token ids)``, ready to submit;
    ``echo_texts``: each prompt's text when a completion asks for ``echo`` (token ids decoded), else None."""

    request: SamplingFields
    prompts: list[tuple[str | None, list[int]]]
    max_tokens: int
    echo_texts: list[str] | None = None


def read_json(body: bytes, max_values: int) -> Any:
    """The JSON value of a request body, or a 400 naming what is wrong with it. A body of more than
    ``max_values`` comma-separated values is refused before it is parsed (parsing holds the GIL)."""
    commas = body.count(b",")
    if commas >= max_values:
        raise APIError(400, f"the request body has {commas + 1} or more values (commas); this server takes at most "
                            f"{max_values} values in one request")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not UTF-8 (byte {exc.start}); send JSON encoded as UTF-8") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError:  # the only other ValueError of json.loads: an integer too long to convert
        raise APIError(400, "the request body has an integer of more than 4300 digits") from None
    _check_tree(value)
    return value


def _check_tree(value: Any) -> None:
    """Depth and lone surrogates, walked without recursion; the error names the field (``a.b[2]``)."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item, path, "a string")
        elif isinstance(item, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise APIError(400, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep",
                               param=path or None)
            if isinstance(item, dict):
                for key, child in item.items():
                    _check_text(key, path, "a field name")
                    stack.append((child, f"{path}.{key}" if path else key, depth + 1))
                continue
            # a list; token ids need no check
            stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(item)
                         if not isinstance(child, int))


def _check_text(text: str, path: str, what: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = f" of {path}" if path else ""
        raise APIError(400, f"{what}{where} has a lone surrogate ({text[exc.start]!r} at character {exc.start}): "
                            "not valid Unicode text", param=path or None) from None


class Preparer:
    """Prepares requests for ``llm`` in one thread of its own (the tokenizer is used from it and from
    the engine thread only). ``max_sequences``: the most sequences one request may have;
    ``max_prompt_bytes``: the text prompt limit (None: :data:`PROMPT_BYTES_PER_TOKEN` per token); ``auto_tools``:
    the tool-call parser that reads ``tool_choice`` ``"auto"``'s calls, where it is served
    (``--enable-auto-tool-choice``; one that reads special tokens has them kept in those requests' text);
    ``responses_store``: the stored responses a Responses request may continue."""

    def __init__(self, llm: LLM, served_model_name: str, chat_template: str | None, max_sequences: int,
                 max_prompt_bytes: int | None = None, auto_tools: ToolParser | None = None,
                 responses_store: ResponseStore | None = None) -> None:
        self.llm, self.served_model_name, self.chat_template = llm, served_model_name, chat_template
        self.auto_tools = auto_tools
        self.responses_store = ResponseStore(0) if responses_store is None else responses_store
        self.max_sequences = max_sequences
        self.max_prompt_bytes = max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * llm.max_model_len
        self.max_values = max_sequences * llm.max_model_len + JSON_VALUES_SLACK
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-prepare")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ endpoints (preparer thread)
    def completion(self, body: bytes) -> Prepared:
        req: CompletionRequest = parse(CompletionRequest, read_json(body, self.max_values))
        self._check_model(req.model)
        prompts = req.prompts()
        self._check_count(len(prompts), req.n)
        for prompt in prompts:
            if isinstance(prompt, str):
                self._check_bytes(len(prompt.encode("utf-8")), "prompt")
        encoded = [self._encoded(p, "prompt") for p in prompts]
        self._check_params(req, req.max_tokens, "max_tokens", encoded)
        return Prepared(req, encoded, req.max_tokens, self._echo_texts(encoded) if req.echo else None)

    def _echo_texts(self, encoded: list[tuple[str | None, list[int]]]) -> list[str]:
        """The text of each prompt (a token-id prompt decoded, special tokens skipped as in outputs)."""
        if self.llm.tokenizer is None and any(text is None for text, _ in encoded):
            raise APIError(400, f"echo of a token-id prompt needs a tokenizer and model {self.served_model_name!r} "
                                "has none", param="echo")
        return [text if text is not None else self.llm.tokenizer.decode(ids, skip_special_tokens=True)
                for text, ids in encoded]

    def chat(self, body: bytes) -> Prepared:
        return self._chat(read_json(body, self.max_values))

    def responses(self, body: bytes) -> tuple[ResponsesRequest, Turn, Prepared]:
        """A Responses API request, its items after the context it continues (a stored response's, or none) and
        the chat request they amount to, prepared (:mod:`.responses_request`, :mod:`.response_store`)."""
        req: ResponsesRequest = parse(ResponsesRequest, read_json(body, self.max_values))
        turn = self.responses_store.turn(req)
        return req, turn, self._translated(req, responses_error, items=turn.items)

    def messages(self, body: bytes) -> tuple[MessagesRequest, Prepared]:
        """An Anthropic Messages request and the chat request it amounts to, prepared (:mod:`.messages_request`)."""
        req = parse(MessagesRequest, read_json(body, self.max_values))
        return req, self._translated(req, messages_error, reasoning=self.llm.reasoning_parser is not None)

    def _translated(self, req: Any, errors: Callable[[APIError], APIError], **options: Any) -> Prepared:
        """The chat request that another API's request ``req`` amounts to (``req.chat_body(**options)``), prepared;
        the chat's errors named by ``errors`` in that API's fields."""
        chat = req.chat_body(**options)  # its errors name that API's fields already
        try:
            return self._chat(chat)
        except APIError as exc:
            raise errors(exc) from None

    def count_tokens(self, body: bytes) -> dict[str, Any]:
        """``/v1/messages/count_tokens``'s answer: the prompt's tokens, as the Messages request would be fed."""
        req: MessagesRequest = parse(MessagesRequest, read_json(body, self.max_values))
        chat = req.chat_body(generate=False, reasoning=self.llm.reasoning_parser is not None)
        try:
            return {"input_tokens": len(self._chat(chat).prompts[0][1])}
        except APIError as exc:
            raise messages_error(exc) from None

    def _chat(self, data: Any) -> Prepared:
        req: ChatRequest = parse(ChatRequest, data)
        self._check_model(req.model)
        self._check_count(1, req.n)
        conversation = req.conversation()
        tools = req.checked_tools()
        if req.tool_choice_name() == "auto":
            if self.auto_tools is None:
                raise APIError(400, "tool_choice 'auto' (the default with tools) needs a server started with "
                                    "--enable-auto-tool-choice --tool-call-parser NAME; or send tool_choice 'none', "
                                    "'required' or a function", param="tool_choice")
            if self.auto_tools.special_tokens:  # the calls' tags are special tokens: the parser reads them
                req = req.model_copy(update={"skip_special_tokens": False})
        size = sum(len(m["content"].encode("utf-8")) for m in conversation) + sum(
            len(json.dumps(x).encode("utf-8")) for x in [*(tools or ()), *(m.get("tool_calls") for m in conversation)]
            if x)
        self._check_bytes(size, "messages")
        prompt = self._encoded(chat_prompt(self.llm.tokenizer, self._render(req, conversation)), "messages")
        if req.max_completion_tokens is not None:
            max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        elif req.max_tokens is not None:
            max_tokens, param = req.max_tokens, "max_tokens"
        else:
            max_tokens, param = self.llm.max_model_len - len(prompt[1]), "max_tokens"
        self._check_params(req, max_tokens, param, [prompt])
        return Prepared(req, [prompt], max_tokens)

    def tokenize(self, body: bytes) -> dict[str, Any]:
        """``/tokenize``'s answer (:mod:`specdec.server.tokenize`)."""
        data = read_json(body, self.max_values)
        chat = isinstance(data, dict) and "messages" in data
        req = parse(TokenizeChat if chat else TokenizePrompt, data)
        self._check_model(req.model)
        if self.llm.tokenizer is None:
            raise APIError(400, f"model {self.served_model_name!r} has no tokenizer", param="prompt")
        text = self._render(req, req.conversation()) if chat else req.prompt
        self._check_bytes(len(text.encode("utf-8")), "messages" if chat else "prompt")
        tokens = self.llm.tokenizer(text, add_special_tokens=req.add_special_tokens)["input_ids"]
        return {"count": len(tokens), "max_model_len": self.llm.max_model_len, "tokens": tokens,
                "token_strs": self.llm.tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None}

    def detokenize(self, body: bytes) -> dict[str, Any]:
        """``/detokenize``'s answer."""
        req = parse(Detokenize, read_json(body, self.max_values))
        self._check_model(req.model)
        if self.llm.tokenizer is None:
            raise APIError(400, f"model {self.served_model_name!r} has no tokenizer", param="tokens")
        vocab = self.llm.target.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens {bad[:5]} are outside the vocabulary (0..{vocab - 1})", param="tokens")
        return {"prompt": self.llm.tokenizer.decode(req.tokens)}

    # ------------------------------------------------------------------ checks
    def _encoded(self, prompt: str | dict[str, Any], param: str) -> tuple[str | None, list[int]]:
        """:meth:`~specdec.llm.LLM.encode_prompt`, a bad prompt a 400 naming ``param`` (and the model by its served
        name, not the folder it was loaded from)."""
        try:
            return self.llm.encode_prompt(prompt, self.served_model_name)
        except SpecDecError as exc:
            raise APIError(400, str(exc), param=param) from None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.served_model_name!r}",
                           param="model", code="model_not_found")

    def _check_count(self, prompts: int, n: int) -> None:
        if prompts * n > self.max_sequences:
            raise APIError(400, f"this request has {prompts * n} sequences ({prompts} prompts x n={n}); this "
                                f"server runs at most {self.max_sequences} at once (max_num_seqs + max_queue_len)",
                           param="n" if prompts == 1 else "prompt")

    def _check_bytes(self, size: int, param: str) -> None:
        if size > self.max_prompt_bytes:
            raise APIError(400, f"the {param} text is {size} bytes; this server takes at most "
                                f"{self.max_prompt_bytes} bytes of prompt text", param=param)

    def _check_params(self, req: SamplingFields, max_tokens: int, param: str,
                      prompts: list[tuple[str | None, list[int]]]) -> None:
        """The sampling parameters (as the Python API checks them), and prompt + max_tokens <= max_model_len."""
        try:
            self.llm.check_params(req.sampling_params(max_tokens, 0))
        except SpecDecError as exc:  # its message starts with the field's name
            field = str(exc).split(" ", 1)[0]  # else a constraint that does not compile
            field = (param if field == "max_tokens" else field if field in type(req).model_fields
                     else req.constraint_source())
            raise APIError(400, str(exc), param=field) from None
        limit = self.llm.max_model_len
        longest = max(len(ids) for _, ids in prompts)
        if longest + max_tokens > limit:
            raise APIError(400, f"{param} is {max_tokens} but the prompt has {longest} tokens and this model's "
                                f"maximum length is {limit} tokens: at most {limit - longest} can be generated",
                           param=param)

    def _render(self, req: ChatRendering, conversation: list[dict[str, Any]]) -> str:
        if not has_template(self.llm.tokenizer, self.chat_template):
            raise APIError(400, NO_TEMPLATE.format(name=self.served_model_name), param="messages")
        try:
            return render(self.llm.tokenizer, conversation, self.chat_template, req.add_generation_prompt,
                          req.continue_final_message, req.chat_template_kwargs, req.checked_tools())
        except SpecDecError as exc:  # bad rendering arguments, a template's own raise_exception(), a template bug
            text = str(exc)
            param = next((name for name in ("continue_final_message", "chat_template_kwargs")
                          if text.startswith(name)), "messages")
            raise APIError(400, text, param=param) from None
