"""The ASGI app: ``create_app(llm)`` builds the FastAPI application of an OpenAI-compatible server.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses`` (and its stored responses:
``GET`` and ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``), ``POST /v1/messages``,
``POST /v1/messages/count_tokens``, ``GET /v1/models``, ``POST /tokenize``, ``POST /detokenize``, ``GET /health``,
``GET /metrics``. Handlers have the body parsed, validated, bounded and encoded
in the :class:`~specdec.server.prepare.Preparer`'s thread (never on the event loop, so a large or
slow request stalls no other client), and hand jobs to the single
:class:`~specdec.server.worker.EngineWorker`; they never touch model state. The worker
starts and stops with the app's lifespan, so the app runs under any ASGI server.

Errors use OpenAI's shape: 400 bad request (the Python API's validation and the limits of
:mod:`specdec.server.prepare`), 401 bad API key, 404
unknown model or route, 413 body too large, 429 queue full, 503 shutting down (both with ``Retry-After``), 500
(logged, never a traceback to the client). A client that disconnects has its sequences aborted before
the next step.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.errors import SpecDecError
from specdec.llm import LLM
from specdec.outputs import TokenLogprobDict
from specdec.server.chat_output import ChatOutputs
from specdec.server.logprobs import (
    chat_logprobs,
    completion_logprobs,
    prompt_completion_logprobs,
)
from specdec.server.messages import MessageShape, anthropic_error
from specdec.server.metrics import ServerMetrics
from specdec.server.prepare import Prepared, Preparer
from specdec.server.protocol import APIError, error_body, new_id, now
from specdec.server.respond import Choice, Submission, answer_shaped, respond
from specdec.server.response_store import DEFAULT_CAPACITY, MAX_PAGE, ResponseStore
from specdec.server.responses import ResponseShape
from specdec.server.worker import EngineWorker, ShuttingDown
from specdec.tools import PARSERS, tool_parser

DEFAULT_MAX_QUEUE_LEN = 256
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
API_KEY_ENV = "SPECDEC_API_KEY"
RETRY_AFTER = 1
"""Seconds a 429 (queue full) or 503 (shutting down) tells a client to wait (``Retry-After``: the ``openai`` client
waits that long before its retry, where it would back off on its own otherwise)."""
MESSAGES_PATH = "/v1/messages"
"""Anthropic's endpoints: their errors are in Anthropic's shape (:func:`error_response`)."""


@dataclass
class ServerState:
    """What the handlers share: the LLM (read-only for them), the worker, the limits."""

    llm: LLM
    worker: EngineWorker
    preparer: Preparer
    metrics: ServerMetrics
    served_model_name: str
    api_key_digest: bytes | None
    max_queue_len: int
    created: int = field(default_factory=now)
    outstanding: int = 0
    draining: bool = False
    in_flight: set[Submission] = field(default_factory=set)
    loop: asyncio.AbstractEventLoop | None = None

    def drain(self, grace: float) -> None:
        """Stop admitting; after ``grace`` seconds end every request still in flight with a 503 in
        OpenAI's shape (streams: an error event, then ``[DONE]``). Call on the event loop, before the
        ASGI server's own graceful timeout cancels the requests with no answer."""
        self.draining = True
        asyncio.get_running_loop().call_later(grace, self.end_in_flight)

    def end_in_flight(self, why: str = "the request did not finish within the graceful shutdown timeout") -> None:
        """End every request in flight with a 503 in OpenAI's shape that says ``why``."""
        for submission in list(self.in_flight):
            submission.end(ShuttingDown(f"the server is shutting down: {why}"))

    def admit(self, count: int) -> None:
        """Count ``count`` new sequences in, or refuse them (503 draining, 429 queue full)."""
        if self.draining:
            raise APIError(503, "the server is shutting down", "service_unavailable")
        limit = self.llm.max_num_seqs + self.max_queue_len
        if self.outstanding + count > limit:
            raise APIError(429, f"the queue is full ({self.outstanding} sequences in flight, limit {limit}); "
                                "retry later", "rate_limit_exceeded")
        self.outstanding += count


def _authorize_with(state: ServerState):
    async def authorize(request: Request) -> None:
        if state.api_key_digest is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if "x-api-key" in request.headers:  # Anthropic's clients' header
            scheme, token = "bearer", request.headers["x-api-key"]
        given = hashlib.sha256(token.strip().encode()).digest()
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, state.api_key_digest):
            raise APIError(401, "missing or invalid API key: send the header 'Authorization: Bearer <key>' (or "
                                "'x-api-key: <key>')", "invalid_request_error", code="invalid_api_key")

    return authorize


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets a 413 (declared length or bytes read)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            response = error_response(scope["path"], 413, self._error().body())
            return await response(scope, receive, send)
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise self._error()
            return message

        await self.app(scope, limited, send)

    def _error(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_bytes} bytes", code="request_too_large")


def create_app(llm: LLM | None = None, *, served_model_name: str | None = None, api_key: str | None = None,
               chat_template: str | None = None, max_queue_len: int = DEFAULT_MAX_QUEUE_LEN,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_prompt_bytes: int | None = None,
               enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
               max_stored_responses: int = DEFAULT_CAPACITY) -> FastAPI:
    """The server of ``llm`` (default: the embedded pair with draft_model speculation, k=4).

    ``served_model_name``: the ``model`` clients send (default: ``llm.model_name``). ``api_key``
    (default: the ``SPECDEC_API_KEY`` variable; None or empty disables auth). ``chat_template``: a
    Jinja template used instead of the tokenizer's. ``max_queue_len``: sequences that may wait for a
    slot beyond the ``max_num_seqs`` running ones (more get 429). ``max_body_bytes``: request size limit.
    ``max_prompt_bytes``: text prompt limit (default 32 bytes per token of ``max_model_len``; see
    :mod:`specdec.server.prepare` for every limit). ``enable_auto_tool_choice``: serve chat's ``tool_choice``
    ``"auto"``, whose calls ``tool_call_parser`` (a name of :data:`specdec.tools.PARSERS`) reads out of the text
    (vLLM's two flags; :mod:`specdec.server.tool_calls`). With ``llm.reasoning_parser``, chat outputs are split
    into ``reasoning_content`` and ``content`` (:mod:`specdec.reasoning`), constrained ones too: their constraint
    holds for the answer. ``max_stored_responses``: the Responses API's responses kept in memory for
    ``previous_response_id`` and ``GET /v1/responses/{id}`` (0: none; :mod:`specdec.server.response_store`).
    """
    parser = None if tool_call_parser is None else tool_parser(tool_call_parser)
    if enable_auto_tool_choice and parser is None:
        raise SpecDecError(f"enable_auto_tool_choice needs a tool-call parser to read the calls: give "
                           f"tool_call_parser ({', '.join(sorted(PARSERS))})")
    if llm is None:
        llm = default_llm()
    if not isinstance(max_queue_len, int) or max_queue_len < 0:
        raise SpecDecError(f"max_queue_len must be an integer >= 0, got {max_queue_len!r}")
    if not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise SpecDecError(f"max_body_bytes must be an integer >= 1, got {max_body_bytes!r}")
    if not isinstance(max_stored_responses, int) or isinstance(max_stored_responses, bool) or max_stored_responses < 0:
        raise SpecDecError(f"max_stored_responses must be an integer >= 0, got {max_stored_responses!r}")
    if max_prompt_bytes is not None and (not isinstance(max_prompt_bytes, int) or max_prompt_bytes < 1):
        raise SpecDecError(f"max_prompt_bytes must be None or an integer >= 1, got {max_prompt_bytes!r}")
    api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    name = served_model_name or llm.model_name
    metrics = ServerMetrics(name)
    metrics.watch_engine(llm.batch_metrics, llm.engine.cache, llm.scheduler, llm.latencies)
    store = ResponseStore(max_stored_responses)
    preparer = Preparer(llm, name, chat_template, llm.max_num_seqs + max_queue_len, max_prompt_bytes,
                        parser if enable_auto_tool_choice else None, store)
    state = ServerState(llm, EngineWorker(llm, metrics), preparer, metrics, name,
                        hashlib.sha256(api_key.encode()).digest() if api_key else None, max_queue_len)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state.loop = asyncio.get_running_loop()
        state.worker.start()
        try:
            yield
        finally:
            state.draining = True
            state.preparer.close()
            await asyncio.to_thread(state.worker.stop)

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.specdec = state
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    _add_error_handlers(app)
    authorized = [Depends(_authorize_with(state))]
    v1 = APIRouter(prefix="/v1", dependencies=authorized)

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": state.created,
                                            "owned_by": "specdec", "root": llm.model_name,
                                            "max_model_len": llm.max_model_len}]}

    async def prepare(request: Request, endpoint) -> Prepared:
        """Run ``endpoint`` (a :class:`Preparer` method) on the body in the preparer's thread. A body of another media
        type than JSON is a 415, as in vLLM (a request without a ``Content-Type`` is read as JSON)."""
        media = request.headers.get("content-type", "application/json").split(";", 1)[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise APIError(415, f"unsupported media type {media!r}: the body must be JSON, sent with Content-Type: "
                                "application/json")
        body = await request.body()
        return await asyncio.get_running_loop().run_in_executor(preparer.pool, endpoint, body)

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        prepared = await prepare(request, preparer.completion)
        head = {"id": new_id("cmpl"), "object": "text_completion", "created": now(), "model": name}
        num_top = prepared.request.logprobs

        def chunk(index: int, text: str, finish: str | None, logprobs: dict[str, Any] | None) -> dict[str, Any]:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

        def prompt_logprobs(index: int) -> dict[str, Any] | None:
            """Choice ``index``'s echoed prompt in the completions shape (None until its prompt's first choice
            scored it); the choice's text offsets go on from the prompt's end."""
            first = submission.choices[index - index % prepared.request.n]
            if first.prompt_logprobs is None:
                return None
            shaped, submission.choices[index].offset = prompt_completion_logprobs(
                prepared.prompts[index // prepared.request.n][1], first.prompt_logprobs, num_top, llm.token_texts)
            return shaped

        def logprobs(choice: Choice, token_ids: list[int], entries: list[TokenLogprobDict]) -> dict[str, Any]:
            lead = prompt_logprobs(submission.choices.index(choice)) if whole and echo is not None else None
            shaped, choice.offset = completion_logprobs(token_ids, entries, num_top, llm.token_texts, choice.offset)
            return shaped if lead is None else {key: lead[key] + shaped[key] for key in shaped}

        def lead(index: int) -> dict[str, Any] | None:
            """A streamed choice's echo: the prompt's text with its logprobs, once they are scored."""
            shaped = prompt_logprobs(index)
            return None if shaped is None else {**head, "choices": [chunk(index, echo[index // n], None, shaped)]}

        submission = Submission(state, prepared)
        echo, n, whole = prepared.echo_texts, prepared.request.n, not prepared.request.stream
        scored = echo is not None and num_top is not None  # an echo with logprobs waits for the prompt's
        opening = [] if echo is None or whole or scored else [
            {**head, "choices": [chunk(i, echo[i // n], None, None)]} for i in range(len(submission.jobs))]

        def body(index: int, text: str, finish: str | None) -> dict[str, Any]:
            return {"text": text if echo is None else echo[index // n] + text, "finish_reason": finish}

        return await respond(request, submission, prepared.request, head, chunk, opening, logprobs, body,
                              lead if scored and not whole else None)

    @v1.post("/chat/completions")
    async def chat(request: Request) -> Response:
        prepared = await prepare(request, preparer.chat)
        head = {"id": new_id("chatcmpl"), "object": "chat.completion.chunk", "created": now(), "model": name}
        req = prepared.request
        num_top = req.top_logprobs or 0
        shaped = ChatOutputs(req, parser, None if llm.reasoning_parser is None else  # a prompt that closed it
                             bool(llm.thinking(*prepared.prompts[0])))

        def chunk(index: int, text: str, finish: str | None, logprobs: dict[str, Any] | None) -> dict[str, Any]:
            delta, finish = shaped.delta(index, text, finish)
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

        def logprobs(choice: Choice, token_ids: list[int], entries: list[TokenLogprobDict]) -> dict[str, Any]:
            return chat_logprobs(token_ids, entries, num_top, llm.token_texts)

        opening = [{**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]}
                   for i in range(req.n)]
        return await respond(request, Submission(state, prepared), req, head, chunk, opening, logprobs,
                             shaped.message)

    @v1.post("/responses")
    async def responses(request: Request) -> Response:
        req, turn, prepared = await prepare(request, preparer.responses)
        chat = ChatOutputs(prepared.request, parser, None if llm.reasoning_parser is None else
                           bool(llm.thinking(*prepared.prompts[0])))
        keep = (lambda response: store.add(response, turn)) if store.keeps(req) else None
        return await answer_shaped(request, Submission(state, prepared), ResponseShape(req, name, chat, keep))

    @v1.get("/responses/{response_id}")
    async def stored_response(request: Request, response_id: str) -> dict[str, Any]:
        if request.query_params.get("stream", "false").lower() != "false":
            raise APIError(400, "stream: only a background response streams again once created, and this server "
                                "runs none", param="stream")
        return store.response(response_id)

    @v1.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return store.delete(response_id)

    @v1.post("/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict[str, Any]:
        store.response(response_id)  # a 404 where there is none
        raise APIError(400, "only a background response can be cancelled, and this server runs none")

    @v1.get("/responses/{response_id}/input_items")
    async def input_items(request: Request, response_id: str) -> dict[str, Any]:
        query = request.query_params
        limit = query.get("limit", "20")
        if not limit.isdigit():
            raise APIError(400, f"limit must be an integer from 1 to {MAX_PAGE}, got {limit!r}", param="limit")
        return store.input_items(response_id, int(limit), query.get("order", "desc"), query.get("after"))

    @v1.post("/messages")
    async def messages(request: Request) -> Response:
        req, prepared = await prepare(request, preparer.messages)
        chat = ChatOutputs(prepared.request, parser, None if llm.reasoning_parser is None else
                           bool(llm.thinking(*prepared.prompts[0])))
        shape = MessageShape(req, name, chat, len(prepared.prompts[0][1]))
        return await answer_shaped(request, Submission(state, prepared), shape)

    @v1.post("/messages/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        return await prepare(request, preparer.count_tokens)

    app.include_router(v1)
    tokens = APIRouter(dependencies=authorized)  # vLLM's, beside /v1

    @tokens.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return JSONResponse(await prepare(request, preparer.tokenize))

    @tokens.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return JSONResponse(await prepare(request, preparer.detokenize))

    app.include_router(tokens)

    @app.get("/health")
    async def health() -> Response:
        if state.draining or not state.worker.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def error_response(path: str, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
                   ) -> JSONResponse:
    """An error (``body`` in OpenAI's shape) answered to a request for ``path``: in Anthropic's shape under
    :data:`MESSAGES_PATH`, as it is elsewhere."""
    if path.startswith(MESSAGES_PATH):
        body = anthropic_error(status, body["error"]["message"])
    return JSONResponse(body, status_code=status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape, or in Anthropic's under ``/v1/messages``."""
    async def api_error(request: Request, exc: APIError) -> Response:
        retry = {"Retry-After": str(RETRY_AFTER)} if exc.status in (429, 503) else None
        return error_response(request.url.path, exc.status, exc.body(), retry)

    async def bad_input(request: Request, exc: SpecDecError) -> Response:
        return error_response(request.url.path, 400, error_body(str(exc), "invalid_request_error"))

    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(request.url.path, exc.status_code, error_body(str(exc.detail), "invalid_request_error"))

    async def internal(request: Request, exc: Exception) -> Response:  # Starlette logs the exception itself
        return error_response(request.url.path, 500,
                              error_body("internal server error (see the server log)", "server_error"))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(SpecDecError, bad_input)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal)


def default_llm() -> LLM:
    """An :class:`LLM` of the embedded default pair with draft_model speculation, k=4."""
    from specdec.assets import require_default_pair

    target, draft = require_default_pair()
    return LLM(str(target), speculative_config={"method": "draft_model", "model": str(draft),
                                                "num_speculative_tokens": 4}, serving=True)
