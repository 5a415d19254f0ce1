"""Prometheus collectors over one engine, under vLLM's metric names, read when a registry is collected.

The server's ``/metrics`` (:class:`specdec.server.metrics.ServerMetrics`) and ``LLM.get_metrics()``
(:mod:`specdec.metrics_reader`) register the same collectors (:func:`watch_engine`), so a figure has one
definition whichever way it is read. Each reads the engine's own state (its
:class:`~specdec.metrics.BatchMetrics`, its target pool and its scheduler) at collection; nothing is
counted twice. Every series carries a ``model_name`` label.

- ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``: sequences in the batch (prefilling
  included) and waiting for a slot.
- ``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total``: prompt tokens submitted, tokens generated
  (a token cut by a stop string is not counted).
- ``vllm:spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total``
  and ``..._num_accepted_tokens_per_pos_total{position}``: steps of a sequence that drafted, draft tokens
  proposed, accepted, and accepted at each draft position (a position once drafted is listed, 0 or not).
- ``vllm:kv_cache_usage_perc``: the fraction (0 to 1, as vLLM reports it) of the target's KV blocks
  referenced by some sequence (cached blocks no sequence references count as free: they are evicted on
  demand). 0 once every request has ended or was aborted: no block leaks.
- ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``: prompt tokens looked up in
  the prefix cache, and of them the tokens found cached (both 0 with prefix caching off).
- ``vllm:num_preemptions_total``: sequences preempted because the pool ran out of blocks.
- ``specdec:kv_cache_blocks`` and ``specdec:kv_cache_block_size``: the pool's size.
- ``specdec:grammar_compiles_total`` / ``specdec:grammar_compile_seconds_total``: structured-output
  constraints compiled (cache misses) and the time it took.
- ``specdec:spec_decode_k_choices_total{batch_size,k}`` / ``specdec:spec_decode_speculation_off_steps_total
  {batch_size}``: the speculation policy's decisions by the step's rows (the power of two at or below).
- ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``, ``vllm:e2e_request_latency_seconds``:
  histograms of seconds (:class:`Latencies`), measured when a step's output is filed with its request: time to
  first token from the request's arrival, inter-token latency per token (a step that emits ``m`` tokens after a
  gap ``g`` counts ``m`` latencies of ``g / m``; the tokens of the first output are covered by the time to first
  token; vLLM observes one latency per step, whatever the step emits), end-to-end latency when it ends.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from specdec.metrics import BatchMetrics
from specdec.models.base import KVCache
from specdec.scheduler import Scheduler

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class Buckets:
    """A histogram's counts: ``counts[i]`` the observations at most ``bounds[i]`` and above the bound before
    (the last, past every bound), and their ``total``."""

    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.total += value * times

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus' buckets: ``(le, observations at most le)``, ``+Inf`` last."""
        running, out = 0, []
        for bound, count in zip([*map(str, self.bounds), "+Inf"], list(self.counts)):
            running += count
            out.append((bound, running))
        return out


@dataclass
class Latencies:
    """An engine's request latencies in seconds, as its ``LLM`` files each step's outputs (see the module's
    docstring): time to first token, inter-token latency per token, end-to-end latency."""

    ttft: Buckets = field(default_factory=lambda: Buckets(TTFT_BUCKETS))
    itl: Buckets = field(default_factory=lambda: Buckets(ITL_BUCKETS))
    e2e: Buckets = field(default_factory=lambda: Buckets(E2E_BUCKETS))

    def record_tokens(self, first: bool, gap: float, count: int) -> None:
        """``count`` tokens filed ``gap`` seconds after the request's previous output (after its arrival when
        ``first``)."""
        if count and first:
            self.ttft.observe(gap)
        elif count:
            self.itl.observe(gap / count, times=count)


def watch_engine(registry: CollectorRegistry, batch: BatchMetrics, cache: KVCache, scheduler: Scheduler,
                 latencies: Latencies, model_name: str) -> None:
    """Register in ``registry`` every collector of an engine: its ``batch`` metrics, its target pool
    (``cache``), its ``scheduler`` and its requests' ``latencies``, labelled ``model_name``."""
    for collector in (SchedulerCollector(scheduler, model_name), SpecDecodeCollector(batch, model_name),
                      LatencyCollector(latencies, model_name), KVCacheCollector(cache, scheduler, model_name),
                      GrammarCollector(batch, model_name), PolicyCollector(batch, model_name)):
        registry.register(collector)


def _family(kind: type[Metric], name: str, doc: str, model_name: str, value: float) -> Metric:
    """A one-series family of ``kind`` (a gauge or counter family) labelled ``model_name``."""
    family = kind(name, doc, labels=["model_name"])
    family.add_metric([model_name], value)
    return family


class SchedulerCollector:
    """Sequences running and waiting in one scheduler."""

    def __init__(self, scheduler: Scheduler, model_name: str) -> None:
        self.scheduler, self.model_name = scheduler, model_name

    def collect(self):
        name = self.model_name
        return [_family(GaugeMetricFamily, "vllm:num_requests_running", "Sequences running in the batch.", name,
                        self.scheduler.num_running),
                _family(GaugeMetricFamily, "vllm:num_requests_waiting", "Sequences waiting for a slot.", name,
                        len(self.scheduler.waiting))]


class SpecDecodeCollector:
    """Tokens in and out, and the drafts proposed and accepted, from an engine's :class:`BatchMetrics`."""

    def __init__(self, batch: BatchMetrics, model_name: str) -> None:
        self.batch, self.model_name = batch, model_name

    def collect(self):
        batch, name = self.batch, self.model_name
        families = [_family(CounterMetricFamily, metric, doc, name, value) for metric, doc, value in (
            ("vllm:prompt_tokens", "Prompt tokens submitted.", batch.num_prompt_tokens),
            ("vllm:generation_tokens", "Tokens generated.", batch.num_generated_tokens),
            ("vllm:spec_decode_num_drafts", "Steps of a sequence that drafted.", batch.num_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", batch.num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", batch.num_accepted_tokens))]
        per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                           "Draft tokens accepted at each draft position.",
                                           labels=["model_name", "position"])
        for position, count in enumerate(list(batch.accepted_per_position)):
            per_position.add_metric([name, str(position)], count)
        return [*families, per_position]


class LatencyCollector:
    """An engine's :class:`Latencies` as vLLM's histograms."""

    def __init__(self, latencies: Latencies, model_name: str) -> None:
        self.latencies, self.model_name = latencies, model_name

    def collect(self):
        families = []
        for name, doc, buckets in (
                ("vllm:time_to_first_token_seconds", "Time to first token.", self.latencies.ttft),
                ("vllm:inter_token_latency_seconds", "Inter-token latency, per token (a step that emits m tokens "
                 "after a gap g counts m latencies of g/m; the first output's tokens count in the time to first "
                 "token).", self.latencies.itl),
                ("vllm:e2e_request_latency_seconds", "End-to-end request latency.", self.latencies.e2e)):
            family = HistogramMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], buckets.cumulative(), sum_value=buckets.total)
            families.append(family)
        return families


class KVCacheCollector:
    """The figures of one engine's target pool (``cache``) and scheduler."""

    def __init__(self, cache: KVCache, scheduler: Scheduler, model_name: str) -> None:
        self.cache, self.scheduler, self.model_name = cache, scheduler, model_name

    def collect(self):
        cache, name = self.cache, self.model_name
        looked_up, found = cache.prefix_cache_counts()
        return [
            _family(GaugeMetricFamily, "vllm:kv_cache_usage_perc",
                    "KV-cache usage: the fraction of blocks in use (1 means 100 percent).", name,
                    cache.num_used_blocks / cache.num_blocks if cache.num_blocks else 0.0),
            _family(GaugeMetricFamily, "specdec:kv_cache_blocks", "Blocks of the target's KV pool.", name,
                    cache.num_blocks),
            _family(GaugeMetricFamily, "specdec:kv_cache_block_size", "Tokens per KV block.", name, cache.block_size),
            _family(CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                    name, looked_up),
            _family(CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", name,
                    found),
            _family(CounterMetricFamily, "vllm:num_preemptions", "Sequences preempted (KV blocks ran out).", name,
                    self.scheduler.num_preemptions),
        ]


class GrammarCollector:
    """Structured-output compilations counted in an engine's :class:`BatchMetrics`."""

    def __init__(self, batch: BatchMetrics, model_name: str) -> None:
        self.batch, self.model_name = batch, model_name

    def collect(self):
        return [_family(CounterMetricFamily, "specdec:grammar_compiles",
                        "Structured-output constraints compiled (grammar cache misses).", self.model_name,
                        self.batch.num_grammar_compiles),
                _family(CounterMetricFamily, "specdec:grammar_compile_seconds",
                        "Seconds spent compiling structured-output constraints.", self.model_name,
                        self.batch.time_grammar_compile)]


def batch_bucket(rows: int) -> str:
    """The label of a step's row count: the power of two at or below it."""
    return str(1 << (rows.bit_length() - 1))


class PolicyCollector:
    """The k-policy's decisions (auto k or a per-batch-size schedule) from an engine's :class:`BatchMetrics`."""

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
