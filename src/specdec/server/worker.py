"""The single engine loop: one thread owns the :class:`~specdec.llm.LLM` and calls its ``step``.

HTTP handlers never touch model state: they hand :class:`Job` objects to the worker
(``submit``/``abort`` put commands on a thread-safe queue) and await each job's outputs on
an asyncio queue of their own. Between two steps the worker applies every queued command
(new sequences join the batch, aborted ones leave it and free their slot), then runs one
step and hands each sequence's new :class:`~specdec.outputs.StreamOutput` to its job. While
nothing runs it sleeps on the command queue; when it falls idle it first returns the free heap to the
system (at most every ``TRIM_EVERY`` seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from specdec.llm import LLM, StreamOutput
from specdec.sampling import SamplingParams
from specdec.server.metrics import ServerMetrics

log = logging.getLogger("specdec.server")


TRIM_EVERY = 5.0
"""Seconds at least between two returns of the free heap to the system (:func:`return_free_heap`)."""


def _libc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


_trim = _libc_trim()


def return_free_heap() -> bool:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim(0)``); False where there is no
    such call. A step's tensors are freed to the heap, which glibc keeps mapped: after a burst of requests the
    server's resident memory would stay at the burst's peak while it idles."""
    if _trim is None:
        return False
    _trim(0)
    return True


class ShuttingDown(RuntimeError):
    """Handed to the jobs still in flight when the worker stops."""


@dataclass(eq=False)
class Job:
    """One sequence a handler waits for: choice ``index`` of its HTTP request.

    ``prompt`` is what :meth:`LLM.submit` takes (already encoded and validated by the handler).
    The worker puts ``(index, StreamOutput | BaseException)`` on ``outbox`` (an asyncio queue
    shared by the jobs of one HTTP request) from its own thread through ``loop``.
    """

    index: int
    prompt: dict[str, Any]
    params: SamplingParams
    outbox: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.perf_counter)
    request_id: str | None = None
    _handle: Any = None

    def deliver(self, item: StreamOutput | BaseException) -> None:
        """Hand ``item`` to the job's event loop (a closed loop means its client is gone)."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.outbox.put_nowait, (self.index, item))


class EngineWorker:
    """Runs ``llm``'s steps in one thread and routes their outputs to the jobs."""

    def __init__(self, llm: LLM, metrics: ServerMetrics) -> None:
        self.llm = llm
        self.metrics = metrics
        self._commands: queue.SimpleQueue[tuple[str, Job | None]] = queue.SimpleQueue()
        self._jobs: dict[str, Job] = {}
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the current step; jobs still in flight get :class:`ShuttingDown`."""
        if self._thread.is_alive():
            self._commands.put(("stop", None))
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        self._commands.put(("submit", job))

    def abort(self, job: Job) -> None:
        self._commands.put(("abort", job))

    # ------------------------------------------------------------------ the loop (worker thread)
    def _run(self) -> None:
        scheduler = self.llm.scheduler
        trimmed = time.monotonic()
        while True:
            if not self._apply_commands(block=not scheduler.has_work):
                break
            if scheduler.has_work:
                self._step()
                if not scheduler.has_work and time.monotonic() - trimmed >= TRIM_EVERY:
                    return_free_heap()  # idle now: nothing waits on this thread
                    trimmed = time.monotonic()
        for job in list(self._jobs.values()):
            self._abort(job)
            job.deliver(ShuttingDown("the server is shutting down"))

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command (waiting for one when ``block``); False on ``stop``."""
        while True:
            try:
                kind, job = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "submit":
                try:
                    job._handle = self.llm.submit(job.prompt, job.params, arrival=job.arrival)
                except Exception as exc:  # validated by the handler already; a failure here is a bug
                    log.exception("submitting a request failed")
                    job.deliver(exc)
                    continue
                job.request_id = job._handle.seq.request_id
                self._jobs[job.request_id] = job
            elif job.request_id in self._jobs:
                self._abort(job)

    def _abort(self, job: Job) -> None:
        self.llm.abort(job.request_id)
        del self._jobs[job.request_id]
        self.metrics.record_abort()

    def _step(self) -> None:
        try:
            outputs = self.llm.step()
        except Exception as exc:
            log.exception("an engine step failed; failing the %d requests in flight", len(self._jobs))
            for job in self._jobs.values():
                job.deliver(exc)
            self._jobs.clear()
            return
        self.metrics.record_step(outputs)
        for out in outputs:
            job = self._jobs.get(out.request_id)
            if job is None:
                continue
            if out.error is not None:  # this request's row failed (its grammar), the others went on
                log.error("request %s failed: %s", out.request_id, out.error)
                del self._jobs[out.request_id]
                job.deliver(out.error)
                continue
            while job._handle.pending:
                item = job._handle.pending.popleft()
                if item.finished:
                    self.metrics.record_finish(item.finish_reason)
                    del self._jobs[out.request_id]
                job.deliver(item)
