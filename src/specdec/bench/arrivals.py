"""Open-loop load: when each request of a serving benchmark arrives, whatever the server is doing.

A closed loop (``c`` clients, each sending its next request when its last one finished) lets the server set its
own load: a method that finishes requests sooner is sent more of them, so at saturation two methods run
different batches and feed different amounts of prompt per second, and their latencies are not comparable. At
a fixed request rate every method is sent the same requests at the same moments, as a server's users send them
(vLLM's ``benchmark_serving --request-rate``): the arrivals form a Poisson process, the gaps between them drawn
from an exponential distribution of mean ``1 / rate``.
"""

from __future__ import annotations

import math
import random

from specdec.errors import SpecDecError


def check_rates(rates: list[float] | None) -> None:
    """Raise a ``SpecDecError`` naming the first request rate that is not a finite number above 0."""
    for rate in rates or ():
        if not (math.isfinite(rate) and rate > 0):
            raise SpecDecError(f"--request-rate levels must be finite numbers of requests per second above 0, "
                               f"got {rate}")


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """The arrival times (seconds after the first, which arrives at 0.0) of ``count`` requests sent at ``rate``
    requests per second on average; the same for the same ``seed``, whichever method is measured."""
    check_rates([rate])
    rng = random.Random(f"arrivals-{seed}-{rate!r}")
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times
