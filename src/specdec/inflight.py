"""The requests in flight, as :class:`~specdec.llm.LLM` keeps them, and how a step's output becomes each request's
next :class:`~specdec.outputs.StreamOutput`: text deltas and stop strings (:class:`~specdec.text.TextTracker`),
vLLM's ``stop_reason``, logprobs in vLLM's form, the prompt's logprobs on a request's first output, and the
latencies of what is filed."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from specdec.engine import Engine, StepOutput
from specdec.engine_metrics import Latencies
from specdec.logprobs import Logprob, TokenLogprobs
from specdec.outputs import StreamOutput, TokenLogprobDict
from specdec.scheduler import Scheduler
from specdec.sequence import Sequence
from specdec.text import TextTracker, TokenTexts


@dataclass(eq=False)
class Request:
    """A submitted request as the API layer sees it: its sequence, text tracker and the
    stream outputs filed for it but not yet taken by its caller."""

    seq: Sequence
    prompt: str | None
    tracker: TextTracker
    pending: deque[StreamOutput] = field(default_factory=deque)
    done: bool = False
    error: BaseException | None = None
    arrival: float = 0.0  # time.perf_counter() when it arrived
    last: float | None = None  # when its last output with tokens was filed
    opened: bool = False  # an output was filed for it (the first carries the prompt's logprobs)


class InFlight:
    """The requests in flight by id. ``file`` turns a step output into its request's next stream output and
    records its latencies in ``latencies``; a finished, failed or aborted request leaves the table."""

    def __init__(self, engine: Engine, scheduler: Scheduler, token_texts: TokenTexts, eos_ids: frozenset[int],
                 latencies: Latencies) -> None:
        self.engine, self.scheduler, self.token_texts = engine, scheduler, token_texts
        self.eos_ids, self.latencies = eos_ids, latencies
        self.requests: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        self.requests[request.seq.request_id] = request

    def abort(self, request_id: str) -> None:
        """Stop a request and free its slot; an unknown or finished id is a no-op."""
        request = self.requests.pop(request_id, None)
        self.scheduler.abort(request_id)
        if request is not None:
            request.done = True

    def file(self, out: StepOutput) -> StepOutput:
        """Turn a step output into its request's next stream output (text, stop strings); a row that ended with an
        error fails its request (and no other). Returns the output as its request keeps it (cut where a stop string
        ended the text: :meth:`Engine.trim`)."""
        request = self.requests.get(out.request_id)
        if request is None:
            return out
        if out.error is not None:
            request.error, request.done = out.error, True
            del self.requests[out.request_id]
            return out
        tracker = request.tracker
        stop_token = out.finish_reason == "stop" and out.token_ids[-1] in request.seq.stop_ids
        kept = tracker.add(out.token_ids, stop_token)
        if kept < len(out.token_ids):
            out = self.engine.trim(out, kept, request.seq.metrics)
        finish_reason = "stop" if tracker.stopped else out.finish_reason
        finished = finish_reason is not None
        text = tracker.delta(final=finished) if tracker.streaming else ""
        logprobs = None if out.logprobs is None else self.logprob_dicts(out.token_ids, out.logprobs)
        params, last = request.seq.params, out.token_ids[-1] if out.token_ids else None
        stop_reason = tracker.stop_reason if tracker.stopped else (  # vLLM's: end-of-sequence is checked first
            last if out.finish_reason == "stop" and last in params.stop_token_ids
            and (params.ignore_eos or last not in self.eos_ids) else None)
        opening, request.opened = not request.opened and params.prompt_logprobs is not None, True
        request.pending.append(StreamOutput(out.token_ids, text, finished, finish_reason, request.seq.metrics,
                                            logprobs, stop_reason, self.prompt_logprobs(request.seq) if opening
                                            else None))
        now = time.perf_counter()
        if out.token_ids:
            first = request.last is None
            self.latencies.record_tokens(first, now - (request.arrival if first else request.last),
                                         len(out.token_ids))
            request.last = now
        if finished:
            self.latencies.e2e.observe(now - request.arrival)
            request.done = True
            del self.requests[out.request_id]
            if not out.finish_reason:  # a stop string ended it before the engine did
                self.scheduler.abort(out.request_id)
        return out

    def prompt_logprobs(self, seq: Sequence) -> list[TokenLogprobDict | None]:
        """vLLM's ``prompt_logprobs`` of a sequence whose prompt was fed: None for its first token."""
        return [None, *self.logprob_dicts(seq.prompt_ids[1:], seq.prompt_logprobs)]

    def logprob_dicts(self, token_ids: list[int], values: list[TokenLogprobs]) -> list[TokenLogprobDict]:
        """vLLM's form of the engine's logprobs of ``token_ids`` (one :data:`TokenLogprobDict` per token)."""
        text = self.token_texts.text
        dicts = []
        for token, value in zip(token_ids, values):
            entry = {token: Logprob(value.logprob, value.rank, text(token))}
            for rank, (top, logprob) in enumerate(zip(value.top_ids, value.top_logprobs), start=1):
                entry.setdefault(top, Logprob(logprob, rank, text(top)))
            dicts.append(entry)
        return dicts

    def fail_all(self, exc: BaseException) -> None:
        """A step failed: every request in flight fails with the same error; the pool is freed."""
        for request_id, request in list(self.requests.items()):
            request.error = exc
            self.scheduler.abort(request_id)
        self.requests.clear()
