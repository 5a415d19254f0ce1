"""The replicas' shared view: each replica's Prometheus metrics with a ``replica`` label, and which
replicas are alive, for ``/metrics`` and ``/health`` behind Ray Serve's proxy.

The proxy sends a request to one replica of its choice, so a replica alone can only tell about
itself. Each replica therefore pushes a snapshot of its metric families (every sample labelled
``replica="<id>"``) and its health to one :class:`Board` (a small Ray Serve deployment of the same
application) every ``push_interval`` seconds; whichever replica answers ``GET /metrics`` renders the
union of the fresh snapshots, and ``GET /health`` counts the fresh healthy ones. A replica that has
not pushed for ``3 * push_interval`` seconds (killed, or stopped) drops out of both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric

REPLICA_LABEL = "replica"
STALE_INTERVALS = 3


@dataclass
class Snapshot:
    """What one replica pushed: its labelled metric families, whether it serves, when."""

    families: list[Metric]
    healthy: bool
    at: float


def labelled(registry: Any, replica: str) -> list[Metric]:
    """The families ``registry.collect()`` yields, each sample with ``replica=<replica>`` added."""
    out = []
    for family in registry.collect():
        copy = Metric(family.name, family.documentation, family.type, family.unit)
        copy.samples = [s._replace(labels={**s.labels, REPLICA_LABEL: replica}) for s in family.samples]
        out.append(copy)
    return out


def render(snapshots: dict[str, Snapshot]) -> bytes:
    """The Prometheus text of every snapshot's families, each family once with all replicas' samples."""
    merged: dict[str, Metric] = {}
    for replica in sorted(snapshots):
        for family in snapshots[replica].families:
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            into.samples.extend(family.samples)

    class _Families:
        def collect(self):
            return list(merged.values())

    return generate_latest(_Families())  # type: ignore[arg-type]


class Board:
    """The snapshots of every replica (the body of the board deployment; called through its handle)."""

    def __init__(self, push_interval: float) -> None:
        self.push_interval = push_interval
        self.snapshots: dict[str, Snapshot] = {}

    def push(self, replica: str, families: list[Metric], healthy: bool) -> None:
        self.snapshots[replica] = Snapshot(families, healthy, time.monotonic())

    def leave(self, replica: str) -> None:
        self.snapshots.pop(replica, None)

    def fresh(self) -> dict[str, Snapshot]:
        """The snapshots pushed within the last ``STALE_INTERVALS`` intervals (older ones are dropped)."""
        limit = time.monotonic() - STALE_INTERVALS * self.push_interval
        self.snapshots = {r: s for r, s in self.snapshots.items() if s.at >= limit}
        return dict(self.snapshots)

    def metrics(self) -> bytes:
        return render(self.fresh())

    def health(self) -> dict[str, bool]:
        """``{replica id: healthy}`` of the fresh replicas."""
        return {r: s.healthy for r, s in sorted(self.fresh().items())}
