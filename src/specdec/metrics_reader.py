"""``LLM.get_metrics()``: an engine's Prometheus metrics as plain objects, in the shapes of vLLM's
``vllm.v1.metrics.reader``, so that a script written for vLLM's offline API reads them unchanged::

    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            num_drafts = metric.value                      # a Counter
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_position = metric.values                   # a Vector: accepted drafts by position

Names are the Prometheus family names without a counter's ``_total`` (as vLLM's reader gives them); the
metrics are those of :mod:`specdec.engine_metrics`, the same figures ``specdec serve`` exposes in
``/metrics`` (the requests' latencies among them, as :class:`Histogram` objects).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

PER_POSITION = ("vllm:spec_decode_num_accepted_tokens_per_pos", "position")
"""The counter family read as a :class:`Vector`, and the label that indexes it."""


@dataclass
class Metric:
    """One series: its family's ``name`` and its labels (``model_name`` and, where a family has more series,
    the labels that tell them apart)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A count that only grows (an integer, or seconds for a ``..._seconds`` counter)."""

    value: int | float


@dataclass
class Gauge(Metric):
    """A value read now."""

    value: float


@dataclass
class Vector(Metric):
    """Counters indexed by position: ``values[i]`` is the counter of ``position="i"``."""

    values: list[int]


@dataclass
class Histogram(Metric):
    """Observations: their ``count`` and ``sum``, and ``buckets`` (upper bound as Prometheus writes it, ``"+Inf"``
    last: the observations at most that bound)."""

    count: int
    sum: float
    buckets: dict[str, int]


def read_metrics(registry: CollectorRegistry) -> list[Metric]:
    """Every counter, gauge and histogram series of ``registry``, the per-position counter as one :class:`Vector`
    per set of its other labels."""
    metrics: list[Metric] = []
    for family in registry.collect():
        if family.name == PER_POSITION[0]:
            vectors: dict[tuple, dict[int, int]] = {}
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    labels = {k: v for k, v in sample.labels.items() if k != PER_POSITION[1]}
                    key = tuple(sorted(labels.items()))
                    vectors.setdefault(key, {})[int(sample.labels[PER_POSITION[1]])] = int(sample.value)
            for key, counts in vectors.items():
                metrics.append(Vector(family.name, dict(key), [counts.get(i, 0) for i in range(max(counts) + 1)]))
        elif family.type == "counter":
            metrics.extend(Counter(family.name, dict(sample.labels), _number(sample.value))
                           for sample in family.samples if sample.name.endswith("_total"))
        elif family.type == "gauge":
            metrics.extend(Gauge(family.name, dict(sample.labels), float(sample.value)) for sample in family.samples)
        elif family.type == "histogram":
            metrics.extend(_histograms(family))
    return metrics


def _number(value: float) -> int | float:
    """A counter's value as an integer where it is whole (token and step counts), else as it is (seconds)."""
    return int(value) if float(value).is_integer() else value


def _histograms(family) -> list[Histogram]:
    """A histogram family's series, one :class:`Histogram` per set of labels (``le`` aside)."""
    series: dict[tuple, dict] = {}
    for sample in family.samples:
        labels = {k: v for k, v in sample.labels.items() if k != "le"}
        entry = series.setdefault(tuple(sorted(labels.items())), {"buckets": {}, "count": 0, "sum": 0.0})
        if sample.name.endswith("_bucket"):
            entry["buckets"][sample.labels["le"]] = int(sample.value)
        elif sample.name.endswith("_count"):
            entry["count"] = int(sample.value)
        elif sample.name.endswith("_sum"):
            entry["sum"] = float(sample.value)
    return [Histogram(family.name, dict(key), e["count"], e["sum"], e["buckets"]) for key, e in series.items()]
