"""Prometheus collectors of the server, under vLLM's metric names so existing dashboards work.

Counters are exposed with prometheus_client's ``_total`` suffix, as vLLM's are
(``vllm:spec_decode_num_drafts_total``, ...). Every collector lives in the app's own
registry (several apps in one process do not collide), with the process collector
(``process_resident_memory_bytes``, ...). specdec's own additions use the ``specdec:`` prefix.
The engine's own figures (requests running and waiting, tokens, drafts, the KV pool, the policy's
decisions) are :mod:`specdec.engine_metrics`' collectors, read at each scrape, the same that
``LLM.get_metrics()`` reads; this module adds what only the server sees.

The requests' latencies are the engine's too (:class:`specdec.engine_metrics.Latencies`), from each request's
arrival at the server (the worker passes it to ``LLM.submit``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest

from specdec.engine import StepOutput
from specdec.engine_metrics import Latencies, watch_engine
from specdec.metrics import BatchMetrics
from specdec.models.base import KVCache
from specdec.scheduler import Scheduler

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DRAFT_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64)
FINISH_REASONS = ("stop", "length", "abort")
"""The ``finished_reason`` labels of ``vllm:request_success_total``."""


class ServerMetrics:
    """The collectors of one served model; ``render()`` is the ``/metrics`` body."""

    def __init__(self, model_name: str) -> None:
        self.registry = registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        label = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*label, *extra], registry=registry)

        self._success = counter("vllm:request_success", "Sequences finished, by finish reason (an aborted one: "
                                "'abort', as vLLM counts it).", ("finished_reason",))
        for reason in FINISH_REASONS:  # every series from the start, at 0, as vLLM's
            self._success.labels(model_name, reason)
        self._aborted = counter("specdec:request_aborted", "Sequences aborted (client gone or shutdown).").labels(
            model_name)
        self.batch_size = Histogram("specdec:step_batch_size", "Sequences in each engine step.", label,
                                    buckets=BATCH_BUCKETS, registry=registry).labels(model_name)
        self.draft_length = Histogram(
            "specdec:spec_decode_draft_tokens_per_step",
            "Draft tokens of each sequence in each step (the k chosen, fewer where the drafter found fewer).",
            label, buckets=DRAFT_BUCKETS, registry=registry).labels(model_name)
        self.steps_without_drafts = counter(
            "specdec:steps_without_drafts",
            "Engine steps in which no sequence drafted (plain decoding, or speculation switched off).").labels(
            model_name)
        self._model_name = model_name

    def watch_engine(self, batch: BatchMetrics, cache: KVCache, scheduler: Scheduler, latencies: Latencies) -> None:
        """Expose an engine's own figures, read at each scrape (:func:`specdec.engine_metrics.watch_engine`: its
        ``batch`` metrics, its target pool ``cache``, its ``scheduler`` and its requests' ``latencies``).
        ``specdec serve`` and the configuration reference both register through here."""
        watch_engine(self.registry, batch, cache, scheduler, latencies, self._model_name)

    def record_step(self, outputs: list[StepOutput]) -> None:
        """Count one engine step: its batch size and each row's draft length."""
        self.batch_size.observe(len(outputs))
        if outputs and not any(out.num_drafted for out in outputs):
            self.steps_without_drafts.inc()
        for out in outputs:
            self.draft_length.observe(out.num_drafted)

    def record_finish(self, reason: str) -> None:
        """A sequence that ended with ``reason`` (``"stop"`` or ``"length"``)."""
        self._success.labels(self._model_name, reason).inc()

    def record_abort(self) -> None:
        """A sequence aborted before it ended (its client went away, or the server is shutting down)."""
        self._aborted.inc()
        self._success.labels(self._model_name, "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
