"""Prometheus collectors of the server, under vLLM's metric names so existing dashboards work.

Counters are exposed with prometheus_client's ``_total`` suffix, as vLLM's are
(``vllm:spec_decode_num_drafts_total``, ...). Every collector lives in the app's own
registry (several apps in one process do not collide), with the process collector
(``process_resident_memory_bytes``, ...). specdec's own additions use the ``specdec:`` prefix.

Latencies are seconds measured by the engine worker when it hands a step's output over:
time to first token from the request's arrival, inter-token latency per token (a step that
emits ``m`` tokens after a gap ``g`` counts ``m`` latencies of ``g / m``; the tokens of the
first output are covered by the time to first token), end-to-end latency at the end.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily

from specdec.engine import StepOutput
from specdec.metrics import BatchMetrics
from specdec.models.base import KVCache
from specdec.scheduler import Scheduler
from specdec.server.kv_metrics import KVCacheCollector

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DRAFT_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64)


class ServerMetrics:
    """The collectors of one served model; ``render()`` is the ``/metrics`` body."""

    def __init__(self, model_name: str) -> None:
        self.registry = registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        label = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*label, *extra], registry=registry)

        self.running = Gauge("vllm:num_requests_running", "Sequences running in the batch.", label,
                             registry=registry).labels(model_name)
        self.waiting = Gauge("vllm:num_requests_waiting", "Sequences waiting for a slot.", label,
                             registry=registry).labels(model_name)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens admitted.").labels(model_name)
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated and returned.").labels(model_name)
        self._success = counter("vllm:request_success", "Sequences finished.", ("finished_reason",))
        self.aborted = counter("specdec:request_aborted", "Sequences aborted (client gone or shutdown).").labels(
            model_name)
        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Steps of a sequence that drafted.").labels(
            model_name)
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.").labels(
            model_name)
        self.num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.").labels(
            model_name)
        self._accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted at each draft position.", ("position",))
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", label,
                              buckets=TTFT_BUCKETS, registry=registry).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency, per token.", label,
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
        """Expose what an engine counts (read at each scrape): its grammar compilations and k-policy decisions
        in ``batch`` (:meth:`watch_grammars`, :meth:`watch_policy`) and its target pool's and ``scheduler``'s
        figures (:class:`~specdec.server.kv_metrics.KVCacheCollector`). ``specdec serve`` and the configuration
        reference both register through here."""
        self.watch_grammars(batch)
        self.watch_policy(batch)
        self.registry.register(KVCacheCollector(cache, scheduler, self._model_name))

    def watch_grammars(self, batch: BatchMetrics) -> None:
        """Expose the structured-output compilations counted in ``batch`` (read at each scrape):
        ``specdec:grammar_compiles_total`` and ``specdec:grammar_compile_seconds_total``."""
        self.registry.register(_GrammarCollector(batch, self._model_name))

    def watch_policy(self, batch: BatchMetrics) -> None:
        """Expose the k-policy's decisions counted in ``batch`` (read at each scrape) by batch size (the
        step's rows, bucketed to the power of two at or below it): ``specdec:spec_decode_k_choices_total``
        (rows given each ``k``) and ``specdec:spec_decode_speculation_off_steps_total``."""
        self.registry.register(_PolicyCollector(batch, self._model_name))

    def record_step(self, outputs: list[StepOutput]) -> None:
        """Count one engine step: its batch size and each row's drafted and accepted tokens."""
        self.batch_size.observe(len(outputs))
        if outputs and not any(out.num_drafted for out in outputs):
            self.steps_without_drafts.inc()
        for out in outputs:
            self.draft_length.observe(out.num_drafted)
            if out.num_drafted:
                self.num_drafts.inc()
                self.num_draft_tokens.inc(out.num_drafted)
                self.num_accepted_tokens.inc(out.num_accepted)
            for position in range(out.num_accepted):
                self._accepted_per_pos.labels(self._model_name, str(position)).inc()

    def record_tokens(self, first: bool, gap: float, count: int) -> None:
        """``count`` tokens handed over ``gap`` seconds after the request's previous output (or after
        its arrival when ``first``)."""
        if count == 0:
            return
        self.generation_tokens.inc(count)
        if first:
            self.ttft.observe(gap)
            return
        for _ in range(count):
            self.itl.observe(gap / count)

    def record_finish(self, reason: str, seconds: float) -> None:
        self._success.labels(self._model_name, reason).inc()
        self.e2e.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _GrammarCollector:
    """Counters read from the engine's :class:`BatchMetrics` when ``/metrics`` is scraped."""

    def __init__(self, batch: BatchMetrics, model_name: str) -> None:
        self.batch, self.model_name = batch, model_name

    def collect(self):
        compiles = CounterMetricFamily("specdec:grammar_compiles",
                                       "Structured-output constraints compiled (grammar cache misses).",
                                       labels=["model_name"])
        compiles.add_metric([self.model_name], self.batch.num_grammar_compiles)
        seconds = CounterMetricFamily("specdec:grammar_compile_seconds",
                                      "Seconds spent compiling structured-output constraints.", labels=["model_name"])
        seconds.add_metric([self.model_name], self.batch.time_grammar_compile)
        return [compiles, seconds]


def batch_bucket(rows: int) -> str:
    """The label of a step's row count: the power of two at or below it."""
    return str(1 << (rows.bit_length() - 1))


class _PolicyCollector:
    """The k-policy's decisions (auto k or a per-batch-size schedule) from the engine's :class:`BatchMetrics`."""

    def __init__(self, batch: BatchMetrics, model_name: str) -> None:
        self.batch, self.model_name = batch, model_name

    def collect(self):
        choices = CounterMetricFamily(
            "specdec:spec_decode_k_choices",
            "Rows given each k by the speculation policy, by batch size (rows of the step, power-of-two bucket).",
            labels=["model_name", "batch_size", "k"])
        totals: dict[tuple[str, int], int] = {}
        for rows, ks in list(self.batch.k_choices_by_batch_size.items()):
            for k, count in list(ks.items()):
                key = (batch_bucket(rows), k)
                totals[key] = totals.get(key, 0) + count
        for (bucket, k), count in sorted(totals.items(), key=lambda item: (int(item[0][0]), item[0][1])):
            choices.add_metric([self.model_name, bucket, str(k)], count)
        off = CounterMetricFamily(
            "specdec:spec_decode_speculation_off_steps",
            "Steps on which the speculation policy drafted for no row though some could, by batch size.",
            labels=["model_name", "batch_size"])
        steps: dict[str, int] = {}
        for rows, count in list(self.batch.speculation_off_steps_by_batch_size.items()):
            steps[batch_bucket(rows)] = steps.get(batch_bucket(rows), 0) + count
        for bucket, count in sorted(steps.items(), key=lambda item: int(item[0])):
            off.add_metric([self.model_name, bucket], count)
        return [choices, off]
