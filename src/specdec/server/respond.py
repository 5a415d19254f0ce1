"""A request's sequences and how their outputs become its HTTP answer.

A :class:`Submission` holds the jobs of one request (prompts x ``n`` choices) on one outbox and what each choice
(:class:`Choice`) has received; :func:`respond` starts it and answers with server-sent events (:func:`events`:
chunks as outputs arrive, in the endpoint's shape) or, once every choice finished, one JSON body. The APIs whose
answer is built from a chat's outputs (the Responses API, Anthropic's Messages API) answer through
:func:`answer_shaped` with their :class:`OutputShape`, whole or as typed events. A client that disconnects has its
sequences aborted.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specdec.errors import SpecDecError
from specdec.metrics import RequestMetrics
from specdec.outputs import StreamOutput, TokenLogprobDict
from specdec.server.logprobs import vllm_prompt_logprobs
from specdec.server.prepare import Prepared
from specdec.server.protocol import APIError, SamplingFields, usage
from specdec.server.worker import Job, ShuttingDown
from specdec.structured.state import GrammarEngineError

if TYPE_CHECKING:
    from specdec.server.app import ServerState
    from specdec.server.chat_output import ChatOutputs


class Choice:
    """What a handler has received of one sequence (``token_ids`` and ``logprobs`` only when it asked for
    logprobs; ``offset``: the characters of text its logprobs have covered, for ``text_offset``)."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.metrics: RequestMetrics | None = None
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobDict] = []
        self.prompt_logprobs: list[TokenLogprobDict | None] | None = None  # the prompt's first choice's only
        self.offset = 0


class Submission:
    """The sequences of one HTTP request: ``len(prompts) * n`` jobs on one outbox, choice index
    ``prompt * n + i`` as in OpenAI's API. ``close()`` aborts what is unfinished (idempotent)."""

    def __init__(self, state: ServerState, prepared: Prepared) -> None:
        self.state = state
        self.outbox: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        fields, n = prepared.request, prepared.request.n
        self.n = n
        self.prompt_tokens = sum(len(ids) for _, ids in prepared.prompts)
        self.jobs = [Job(p * n + c, {"prompt": text, "prompt_token_ids": ids},
                         fields.sampling_params(prepared.max_tokens, c), self.outbox, loop)
                     for p, (text, ids) in enumerate(prepared.prompts) for c in range(n)]
        self.choices = [Choice() for _ in self.jobs]
        self._closed = True

    def start(self) -> None:
        self.state.admit(len(self.jobs))
        self._closed = False
        self.state.in_flight.add(self)
        for job in self.jobs:
            self.state.worker.submit(job)

    def end(self, error: ShuttingDown) -> None:
        """End the request now: its handler gets ``error`` next; unfinished sequences are aborted."""
        self.outbox.put_nowait((None, error))
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.state.in_flight.discard(self)
        self.state.outstanding -= len(self.jobs)
        for job, choice in zip(self.jobs, self.choices):
            if choice.finish_reason is None:
                self.state.worker.abort(job)

    async def updates(self) -> AsyncIterator[tuple[int, StreamOutput]]:
        """``(index, output)`` as outputs arrive, until every choice finished."""
        remaining = len(self.jobs)
        while remaining:
            index, item = await self.outbox.get()
            if isinstance(item, ShuttingDown):
                raise APIError(503, str(item), "service_unavailable")
            if isinstance(item, SpecDecError):
                raise APIError(400, str(item))
            if isinstance(item, GrammarEngineError):  # this request's constraint, not the step, failed
                raise APIError(500, str(item), "server_error")
            if isinstance(item, BaseException):
                raise APIError(500, "internal server error (the engine step failed; see the server log)",
                               "server_error")
            choice = self.choices[index]
            choice.pieces.append(item.text)
            choice.num_tokens += len(item.token_ids)
            if item.logprobs is not None:
                choice.token_ids.extend(item.token_ids)
                choice.logprobs.extend(item.logprobs)
            if item.prompt_logprobs is not None:
                choice.prompt_logprobs = item.prompt_logprobs
            if item.finished:
                choice.finish_reason, choice.metrics = item.finish_reason, item.metrics
                choice.stop_reason = item.stop_reason
                remaining -= 1
            yield index, item

    def usage(self) -> dict[str, Any]:
        total = RequestMetrics()
        for choice in self.choices:
            if choice.metrics is not None:
                total.merge(choice.metrics)
        # Each prompt counted once, as its first choice found the cache (the others find the first's blocks).
        firsts = [choice.metrics for choice in self.choices[:: self.n]]
        cached = None if None in firsts else sum(m.num_cached_tokens for m in firsts)
        return usage(self.prompt_tokens, sum(c.num_tokens for c in self.choices), total, cached)

    def choice_usage(self, index: int, completion_tokens: int | None = None) -> dict[str, Any]:
        """One choice's usage, with the tokens it has received so far unless ``completion_tokens`` is given."""
        prompt = self.jobs[index].prompt["prompt_token_ids"]
        tokens = self.choices[index].num_tokens if completion_tokens is None else completion_tokens
        return usage(len(prompt), tokens, None)


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(request: Request, submission: Submission) -> bool:
    """Wait for every choice; False when the client disconnected first (its sequences are aborted)."""
    watcher = asyncio.ensure_future(_disconnected(request))
    updates = submission.updates()
    try:
        while True:
            following = asyncio.ensure_future(anext(updates, None))
            done, _ = await asyncio.wait({following, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if following not in done:
                following.cancel()
                return False
            if following.result() is None:
                return True
    finally:
        watcher.cancel()
        submission.close()


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events that always close their submission, even when the client left before
    the first event was produced."""

    def __init__(self, content: AsyncIterator[str], submission: Submission) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.submission = submission

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.submission.close()


async def events(submission: Submission, fields: SamplingFields, chunk, opening: list[dict[str, Any]],
                  head: dict[str, Any], logprobs, lead=None) -> AsyncIterator[str]:
    """The event stream of a submission: ``opening`` chunks, one chunk per output with text, tokens with
    logprobs or the finish (``chunk(index, text, finish_reason, logprobs)``; ``logprobs(choice, token_ids,
    entries)`` builds the endpoint's shape), the usage chunk when asked, then ``[DONE]``.

    ``lead(index)``: a choice's first chunk, or None until it can be built (an echoed prompt with its logprobs,
    which its prompt's first choice scores); a choice's outputs wait behind its lead, in order."""
    def render(index: int, item: StreamOutput, usage: dict[str, Any] | None) -> str | None:
        """The event of an output, or None where its chunk carries nothing (text a tool call holds back)."""
        choice = submission.choices[index]
        finish = item.finish_reason if item.finished else None
        shaped = logprobs(choice, item.token_ids, item.logprobs) if item.logprobs and item.token_ids else None
        piece = chunk(index, item.text, finish, shaped)
        if not any(value for key, value in piece.items() if key != "index"):
            return None
        data = {**head, "choices": [piece]}
        if finish is not None:  # vLLM's stop_reason: the stop string or stop token id that ended it
            data["choices"][0]["stop_reason"] = item.stop_reason
        if usage is not None:
            data["usage"] = usage
        return _sse(data)

    waiting = set(range(len(submission.jobs))) if lead is not None else set()
    held: dict[int, list[tuple[StreamOutput, dict[str, Any] | None]]] = {}
    try:
        for data in opening:  # a chat's role chunks: with continuous usage, the prompt's and no completion
            yield _sse({**data, "usage": submission.choice_usage(data["choices"][0]["index"])}
                       if fields.continuous_usage else data)
        async for index, item in submission.updates():
            for ready in sorted(waiting):
                first = lead(ready)
                if first is None:
                    continue
                waiting.discard(ready)
                yield _sse({**first, "usage": submission.choice_usage(ready, 0)} if fields.continuous_usage else first)
                for queued, usage in held.pop(ready, []):
                    if (event := render(ready, queued, usage)) is not None:
                        yield event
            if not item.text and not item.finished and not (item.logprobs and item.token_ids):
                continue
            usage = submission.choice_usage(index) if fields.continuous_usage else None
            if index in waiting:
                held.setdefault(index, []).append((item, usage))
                continue
            if (event := render(index, item, usage)) is not None:
                yield event
        if fields.include_usage:
            yield _sse({**head, "choices": [], "usage": submission.usage()})
    except APIError as exc:
        yield _sse(exc.body())
    finally:
        submission.close()
    yield _sse("[DONE]")


async def respond(request: Request, submission: Submission, fields: SamplingFields, head: dict[str, Any], chunk,
                   opening: list[dict[str, Any]], logprobs, body, lead=None) -> Response:
    """Start the submission and answer with an event stream (``opening``, ``lead``: as :func:`events` takes them)
    or, once every choice finished, one body (``body(index, text, finish_reason)``: a choice's endpoint fields, its
    text or message and its finish reason)."""
    submission.start()
    if fields.stream:
        return EventStream(events(submission, fields, chunk, opening, head, logprobs, lead), submission)
    if not await collect(request, submission):
        return Response(status_code=499)  # nobody is listening any more
    choices = []
    wants_logprobs = fields.num_logprobs() is not None
    for index, choice in enumerate(submission.choices):
        shaped = logprobs(choice, choice.token_ids, choice.logprobs) if wants_logprobs else None
        choices.append({"index": index, **body(index, "".join(choice.pieces), choice.finish_reason),
                        "logprobs": shaped, "stop_reason": choice.stop_reason})
        if fields.prompt_logprobs is not None:  # vLLM's, from the prompt's first choice
            choices[-1]["prompt_logprobs"] = vllm_prompt_logprobs(
                submission.choices[index - index % fields.n].prompt_logprobs)
    obj = "chat.completion" if head["object"] == "chat.completion.chunk" else "text_completion"
    return JSONResponse({**head, "object": obj, "choices": choices, "usage": submission.usage()})


class OutputShape(Protocol):
    """One answer of an API built from a single chat choice's outputs (``chat``: their reasoning, content and tool
    calls), as typed events: each step returns the events it makes, the last one the whole answer too."""

    chat: ChatOutputs
    stream: bool

    def opening(self) -> list[dict[str, Any]]:
        """The events before any output."""

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat delta (a whole message is one delta too, its calls indexed)."""

    def finish(self, finish_reason: str | None, stop_reason: str | int | None, usage: dict[str, Any]
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing events and the whole answer (``finish_reason`` as the chat shapes it)."""

    def error(self, exc: APIError) -> dict[str, Any]:
        """The event of an error once the stream has begun."""


def typed_sse(event: dict[str, Any]) -> str:
    """A typed event: its ``event:`` line names its ``type``."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def _typed_events(submission: Submission, shape: OutputShape) -> AsyncIterator[str]:
    try:
        for event in shape.opening():
            yield typed_sse(event)
        shaped = None  # the finish reason as the chat shapes it (tool_calls where the output was calls)
        async for _, item in submission.updates():
            delta, finish = shape.chat.delta(0, item.text, item.finish_reason if item.finished else None)
            shaped = finish or shaped
            for event in shape.feed(delta):
                yield typed_sse(event)
        for event in shape.finish(shaped, submission.choices[0].stop_reason, submission.usage())[0]:
            yield typed_sse(event)
    except APIError as exc:
        yield typed_sse(shape.error(exc))
    finally:
        submission.close()


async def answer_shaped(request: Request, submission: Submission, shape: OutputShape) -> Response:
    """Start the submission (one choice) and answer with ``shape``'s event stream or, once it finished, its whole
    answer."""
    submission.start()
    if shape.stream:
        return EventStream(_typed_events(submission, shape), submission)
    if not await collect(request, submission):
        return Response(status_code=499)  # nobody is listening any more
    choice = submission.choices[0]
    shaped = shape.chat.message(0, "".join(choice.pieces), choice.finish_reason)
    message = shaped["message"]
    shape.feed({**message, "tool_calls": [{**call, "index": i} for i, call in enumerate(message.get("tool_calls")
                                                                                        or ())]})
    return JSONResponse(shape.finish(shaped["finish_reason"], choice.stop_reason, submission.usage())[1])
