"""The middleware that Ray Serve's HTTP proxy runs in front of every replica: errors in OpenAI's shape.

A replica answers in OpenAI's shape itself; what it cannot answer is its own death. When a replica
dies (killed, out of memory, its node lost) Ray Serve's proxy ends the requests it was serving: one
whose response had not started yet gets no answer or a plain-text 500, one that was streaming is cut
short. :class:`OpenAIErrors` turns each of these into what a client of the single-process server
would see: a 503 with an ``{"error": {...}}`` body, or, in a stream that had started, an error event
followed by ``data: [DONE]``. Plain-text errors of the proxy itself (404 for a path no application
serves, 408 for a request timeout, 503 while no replica is up) get the same JSON shape.

This module runs inside the proxy process, so it imports neither torch nor ray.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

REPLICA_LOST = ("the replica serving this request stopped before the request finished (Ray Serve replaces it); "
                "retry the request")
ERROR_TYPES = {408: "timeout_error", 429: "rate_limit_exceeded", 503: "service_unavailable"}
"""Error types besides OpenAI's ``invalid_request_error`` (4xx) and ``server_error`` (5xx)."""


def error_body(message: str, type_: str) -> dict[str, Any]:
    """OpenAI's error shape (as :func:`specdec.server.protocol.error_body`, without importing torch)."""
    return {"error": {"message": message, "type": type_, "param": None, "code": None}}


def _json_response(status: int, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    data = json.dumps(body).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]}
    return start, {"type": "http.response.body", "body": data, "more_body": False}


def _error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "server_error" if status >= 500 else "invalid_request_error"


class OpenAIErrors:
    """Pure ASGI middleware (``starlette.middleware.Middleware(OpenAIErrors)`` in Ray Serve's
    ``http_options``): every HTTP response that leaves the proxy is complete and, when it is an error,
    in OpenAI's shape."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        response = _Response(send)
        try:
            await self.app(scope, receive, response.relay)
        finally:
            with contextlib.suppress(Exception):  # a client that is gone cannot be answered
                await response.finish()


class _Response:
    """What one response has sent so far, and the rewriting of what the proxy sends."""

    def __init__(self, send) -> None:
        self.send = send
        self.started = False
        self.finished = False
        self.stream = False
        self.done = False
        self.tail = b""
        self.rewrite: int | None = None  # the status of a plain-text error being replaced
        self.rewritten = b""

    async def relay(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            headers = {k.lower(): v for k, v in message.get("headers", [])}
            kind = headers.get(b"content-type", b"")
            if message["status"] >= 400 and not kind.startswith(b"application/json"):
                self.rewrite = message["status"]
                return
            self.stream = kind.startswith(b"text/event-stream")
            self.started = True
            return await self.send(message)
        if message["type"] != "http.response.body":
            return await self.send(message)
        body, more = message.get("body", b""), message.get("more_body", False)
        if self.rewrite is not None:
            self.rewritten += body
            if not more:
                text = self.rewritten.decode(errors="replace").strip() or "error"
                await self._send_json(self.rewrite, error_body(text, _error_type(self.rewrite)))
            return
        if self.stream:
            seen = self.tail + body
            self.done = self.done or b"data: [DONE]" in seen
            self.tail = seen[-16:]
            if not more and not self.done:  # a stream that ends without [DONE] was cut short
                if body:
                    await self.send({"type": "http.response.body", "body": body, "more_body": True})
                return await self._end_stream()
        if not more:
            self.finished = True
        await self.send(message)

    async def finish(self) -> None:
        """After the proxy is done: complete a response it left unfinished."""
        if self.finished:
            return
        if not self.started:
            await self._send_json(503, error_body(REPLICA_LOST, "service_unavailable"))
        elif self.stream:
            await self._end_stream()
        else:
            self.finished = True
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _send_json(self, status: int, body: dict[str, Any]) -> None:
        start, end = _json_response(status, body)
        self.started = self.finished = True
        await self.send(start)
        await self.send(end)

    async def _end_stream(self) -> None:
        self.finished = True
        event = "data: " + json.dumps(error_body(REPLICA_LOST, "service_unavailable")) + "\n\ndata: [DONE]\n\n"
        await self.send({"type": "http.response.body", "body": event.encode(), "more_body": False})
