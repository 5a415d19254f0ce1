"""Prometheus collectors of the server, under vLLM's metric names so existing dashboards work.

Counters are exposed with prometheus_client's ``_total`` suffix, as vLLM's are
(``vllm:spec_decode_num_drafts_total``, ...). Every collector lives in the app's own
registry (several apps in one process do not collide), with the process collector
(``process_resident_memory_bytes``, ...). specdec's own additions use the ``specdec:`` prefix.
The engine's own figures (requests running and waiting, tokens, drafts, the KV pool, the policy's
decisions) are :mod:`specdec.engine_metrics`' collectors, read at each scrape, the same that
``LLM.get_metrics()`` reads; this module adds what only the server sees.

Latencies are seconds measured by the engine worker when it hands a step's output over:
time to first token from the request's arrival, inter-token latency per token (a step that
emits ``m`` tokens after a gap ``g`` counts ``m`` latencies of ``g / m``; the tokens of the
first output are covered by the time to first token), end-to-end latency at the end. (vLLM observes one
inter-token latency per step, whatever the step emits.)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest

from specdec.engine import StepOutput
from specdec.engine_metrics import watch_engine
from specdec.metrics import BatchMetrics
from specdec.models.base import KVCache
from specdec.scheduler import Scheduler

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)
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
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", label,
                              buckets=TTFT_BUCKETS, registry=registry).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency, per token (a step that emits "
                             "m tokens after a gap g counts m latencies of g/m; the first output's tokens count in "
                             "the time to first token).", label,
                             buckets=ITL_BUCKETS, registry=registry).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", label,
                             buckets=E2E_BUCKETS, registry=registry).labels(model_name)
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

    def watch_engine(self, batch: BatchMetrics, cache: KVCache, scheduler: Scheduler) -> None:
        """Expose an engine's own figures, read at each scrape (:func:`specdec.engine_metrics.watch_engine`: its
        ``batch`` metrics, its target pool ``cache`` and its ``scheduler``). ``specdec serve`` and the
        configuration reference both register through here."""
        watch_engine(self.registry, batch, cache, scheduler, self._model_name)

    def record_step(self, outputs: list[StepOutput]) -> None:
        """Count one engine step: its batch size and each row's draft length."""
        self.batch_size.observe(len(outputs))
        if outputs and not any(out.num_drafted for out in outputs):
            self.steps_without_drafts.inc()
        for out in outputs:
            self.draft_length.observe(out.num_drafted)

    def record_tokens(self, first: bool, gap: float, count: int) -> None:
        """``count`` tokens handed over ``gap`` seconds after the request's previous output (or after
        its arrival when ``first``)."""
        if count == 0:
            return
        if first:
            self.ttft.observe(gap)
            return
        for _ in range(count):
            self.itl.observe(gap / count)

    def record_finish(self, reason: str, seconds: float) -> None:
        """A sequence that ended with ``reason`` (``"stop"`` or ``"length"``) ``seconds`` after it arrived."""
        self._success.labels(self._model_name, reason).inc()
        self.e2e.observe(seconds)

    def record_abort(self) -> None:
        """A sequence aborted before it ended (its client went away, or the server is shutting down)."""
        self._aborted.inc()
        self._success.labels(self._model_name, "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
