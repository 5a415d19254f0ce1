"""How many prompt tokens a step may feed beside the running streams, from measured time (chunked
prefill's default on a CPU).

A scheduler step that feeds ``C`` prompt tokens beside the decoding step of the running sequences takes
``T(C)`` seconds, and every running stream waits that long between two tokens. The prompt tokens share the
decoding step's forward where the backend fuses them (:mod:`specdec.models.segments`), else they are their
own forwards before it; either way ``T`` grows with every token on a CPU, and a fixed token budget cannot
bound a stream's latency: 128 tokens moved the embedded pair's p99 inter-token latency 2.3-4.8x
(``docs/lab-notes/2026-11-24-serving.md``). The pacer keeps what the prompt tokens add to a step within
``SHARE`` (by default, else the ``share`` it is given) of plain decoding's step at the running rows: a plain
step feeding prompts takes at most ``(1 + SHARE) T(0)``, and a drafting step its own time plus that share.

The measurement. Each step that ran streams reports its seconds ``T``, the seconds it drafted, the prompt
tokens it fed ``C``, its decoding tokens ``D`` (one per running row plus the drafts it verified) and those drafts.
The drafting is timed, so it is taken out of ``T``. The two other costs are measured apart:

- the decoding step ``T0(D) = c + e D``, through the last ``PLAIN_WINDOW`` steps that fed no prompt token,
  robustly: ``e`` the median of the slopes between two of them (each weighing the widths apart, and less the older
  the older of the two, by ``SLOPE_DECAY`` per such step), ``c`` the median intercept of the last
  ``INTERCEPT_STEPS``;
- ``b``, what a prompt token adds to a step: over the last ``WINDOW`` steps that fed prompts (weights decaying by
  ``DECAY`` per such step), least squares through the origin of their time beyond the decoding step at their
  width, ``T - T0(D) = b C`` (``b`` at least 0);
- ``a = T0(R)``, plain decoding's step at the last step's rows ``R`` (its decoding tokens but its drafts): the
  share is of the step every method's rows take without drafts, so a drafting step feeds the prompt tokens a
  plain step at its rows would (why, below);
- ``C = SHARE a / b``, within ``[MIN_PACED_CHUNK, cap]``, ``cap`` the scheduler's token budget; with no stream
  running (nobody's latency to keep), ``cap``; while ``b`` is not measured (or measured at 0: on a CPU a prompt
  token always costs something, and the whole budget beside running streams took about five decoding steps at the
  ``1b`` shape, ``docs/lab-notes/2026-11-29-flood.md``), ``MIN_PACED_CHUNK`` (whose step
  measures it: the whole budget would measure it better, but every running stream waits through that step,
  which took 4-5 decoding steps on the embedded pair, ``docs/lab-notes/2026-11-28-fused-prefill.md``).

``D`` is in the decoding step because that step is not one size. With speculation its width changes from step
to step with the drafts chosen, and more so at saturation, where the steps feeding prompts are those that
run more rows: priced against the mean step without prompts, a prompt token came out 1.5-2x its cost
(eagle at 16 streams on the embedded pair, ``docs/lab-notes/2026-11-28-pacer-fit.md``). Until the steps without
prompt tokens were measured at two widths, a decoding token is priced as a prompt token (``e = b``, solved with
``b``): in a fused forward both are one more token through the same weights.

Why the share is of plain decoding's step, not of the last step drafts and drafting included (until 2026-11-30):
a drafting step then fed prompts in proportion to its own length, so under a step bound ``R`` a drafting step
that fed prompts took up to ``R`` times plain decoding's paced step, where it now takes at most ``(R + SHARE) /
(1 + SHARE)`` of it (1.17 at ``R`` = 1.25), and a method's closed loop fed prompts by its drafts. At 16 streams at
the ``1b`` shape on an AMX host, over five rounds, eagle's p99 inter-token latency went from 1.35x plain
decoding's to 1.08x with throughput from 1.00x to 1.05x; draft_model's moved within what plain decoding moved
against itself; speculation's median time to first token rose 1.26-1.32x (``docs/lab-notes/2026-11-30-amx-host.md``).

Why apart and robust, not one least-squares fit ``T = c + e D + b C`` (until 2026-11-30): at saturation only one
step in ``PROBE_EVERY`` feeds no prompt, so in a joint fit that one step alone set the intercept, and in a ramp
``D`` and ``C`` grow together. One probe the machine slowed 1.7x (64 streams at the ``1b`` shape) took ``b`` from
19 ms to 7-11 ms for sixteen steps; the chunks grew from 19 to 89 tokens, the steps from 1.3 to 3.6 s and the rows
decoding from 20 to 45, and that run's p99 inter-token latency was 2.2x plain decoding's; in a 16-stream ramp the
fit gave prompt tokens' cost to the decoding tokens in the same way (``docs/lab-notes/2026-11-29-catch-up.md``).
Measured apart with medians, one slow step without prompts moves neither the slope nor the intercept, and a slow
step feeding prompts prices a token dearer: the error feeds fewer prompt tokens, not more
(``docs/lab-notes/2026-11-30-pacer-apart.md``).

Where prompts wait at every step (a flood, or a saturated server), every step would feed the budget, and a
constant ``C`` cannot be told from the decoding step: so a step that comes ``PROBE_EVERY`` steps after the
last one without prompt tokens (or the first paced one) feeds none. It costs the prompts one step of progress
in ``PROBE_EVERY``, and the streams nothing.

The floor keeps a prompt moving however slow a prefill is: a chunk of ``MIN_PACED_CHUNK`` tokens a step.

The line is not trusted far past what it measured: a step feeds at most ``REACH`` times the most prompt
tokens a recent step fed (that most decaying by ``DECAY`` per step), so a chunk grows by doubling from the
floor. Fitted on chunks of up to 8 tokens beside three streams at the ``1b`` shape, the line once priced a
token at 4 ms (it costs 15-17) and the next step fed 71 tokens: 1.5 s, where the share allows 0.9
(``docs/lab-notes/2026-11-29-probes.md``).
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left
from collections import deque
from itertools import accumulate

from specdec.errors import SpecDecError

MIN_PACED_CHUNK = 8
"""Prompt tokens a paced step feeds at least: the prompt's progress when even that exceeds the share of a
decoding step. It was one KV block (16) until 2026-11-29, which overrode the share where it binds: at one
stream on the embedded pair ``SHARE a / b`` is 8-9 tokens, and the floor's 16 doubled every step of a flood
(``docs/lab-notes/2026-11-29-flood.md``)."""

SHARE = 0.5
"""What the prompt tokens of a paced step may add to it by default, as a share of plain decoding's step at the
running rows: a running stream's inter-token latency stays within 1.5 times a step without prompts or drafts (a
drafting step's, within its own time plus half of that; the serving targets allow 2).
``prefill_share`` (``--prefill-share``) sets another: more lowers the waiting prompts' time to first token and
raises the running streams' inter-token latency (``docs/lab-notes/2026-11-29-prefill-share.md``)."""

DECAY = 0.95
"""Weight of the past per step: of a step that fed prompt tokens in a token's price (about the last twenty count),
and of the most prompt tokens a step fed."""

WINDOW = 64
"""Steps that fed prompt tokens kept for the price of a token (the oldest weighs ``DECAY ** 63``, about 4%)."""

PLAIN_WINDOW = 8
"""Steps that fed no prompt token kept for the decoding step (at saturation the probes of the last
``PLAIN_WINDOW * PROBE_EVERY`` steps; else the last eight steps)."""

SLOPE_DECAY = 0.8
"""Weight of the past per step without prompt tokens in the decoding step's slope: the step is not a line (at the
``1b`` shape on a CPU a second decoding token adds about 50 ms, the twentieth about 15), so the widths measured
lately count most."""

INTERCEPT_STEPS = 3
"""The latest steps without prompt tokens whose median sets the decoding step's intercept (the slope comes from
all ``PLAIN_WINDOW``): it follows the machine's speed, and takes two slow steps in a row to move."""

PROBE_EVERY = 16
"""Steps with prompt tokens after which one feeds none, so that the decoding step is measured."""

REACH = 2
"""How many times the most prompt tokens a recent step fed the next step may feed."""


def check_prefill_share(value: object) -> float:
    """``value`` as a share of a decoding step once it is one: a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise SpecDecError(f"prefill_share must be a number > 0 (what a step's prompt tokens may add to it, as a "
                           f"share of a decoding step), got {value!r}")
    return float(value)


class PrefillPacer:
    """The prompt tokens of the next step, from the measured decoding step and price of a prompt token;
    ``share``: what they may add to a decoding step, as a share of it (``SHARE`` above)."""

    def __init__(self, share: float = SHARE) -> None:
        self.share = check_prefill_share(share)
        self._plain: deque[tuple[float, float]] = deque(maxlen=PLAIN_WINDOW)  # (D, T) of steps without prompts
        self._fed: deque[tuple[float, float, float]] = deque(maxlen=WINDOW)  # (C, D, T) of steps that fed prompts
        self._last_rows = 0.0  # the rows the last step measured decoded (its decoding tokens but its drafts)
        self._since_plain = PROBE_EVERY  # steps since the last one that fed no prompt token
        self._widest = 0.0  # the most prompt tokens a step fed, decayed per step

    def observe(self, tokens: int, decoding: int, seconds: float, drafting: float = 0.0, drafted: int = 0) -> None:
        """A scheduler step that ran the running streams' ``decoding`` tokens (rows plus the ``drafted`` tokens it
        verified) and fed ``tokens`` prompt tokens (0: none) took ``seconds``, ``drafting`` of them in the drafter."""
        self._since_plain = 0 if tokens == 0 else self._since_plain + 1
        d = float(decoding)
        self._last_rows = d - drafted
        self._widest = max(float(tokens), self._widest * DECAY)
        if tokens == 0:
            self._plain.append((d, seconds - drafting))
        else:
            self._fed.append((float(tokens), d, seconds - drafting))

    def decoding_step(self) -> tuple[float, float] | None:
        """``(c, e)``: the decoding step ``c + e D`` through the kept steps without prompt tokens, robustly: ``e``
        the median of the slopes between two of them, each weighing the widths apart and less the older the older
        of the two (``e >= 0``), ``c`` the median intercept of the latest ``INTERCEPT_STEPS``, so that one step the
        machine slowed moves neither; None until they were measured at two widths."""
        plain = list(self._plain)
        ages = range(len(plain) - 1, -1, -1)
        slopes = sorted(((t2 - t1) / (d2 - d1), abs(d2 - d1) * SLOPE_DECAY**age)  # weighed apart and by the older's age
                        for i, ((d1, t1), age) in enumerate(zip(plain, ages)) for d2, t2 in plain[i + 1:] if d2 != d1)
        if not slopes:
            return None
        weights = list(accumulate(w for _, w in slopes))
        e = max(0.0, slopes[bisect_left(weights, weights[-1] / 2)][0])  # the weighted median
        return statistics.median(t - e * d for d, t in plain[-INTERCEPT_STEPS:]), e

    def line(self) -> tuple[float, float] | None:
        """``(a, b)``: plain decoding's step ``a`` at the last step's rows, ``b`` seconds a prompt token adds to it;
        None until a step without prompt tokens and one with them were measured."""
        if not self._fed or not self._plain:
            return None
        fitted = self.decoding_step()
        if fitted is None:  # one width measured: a decoding token priced as a prompt token, e = b
            width, step = self._plain[0][0], statistics.median(t for _, t in self._plain)
            over = [(x + d - width, t - step) for x, d, t in self._fed]
        else:
            over = [(x, t - fitted[0] - fitted[1] * d) for x, d, t in self._fed]  # (C, time beyond the decoding step)
        weights = [DECAY**age for age in range(len(over) - 1, -1, -1)]
        sxx = sum(wt * x * x for wt, (x, _) in zip(weights, over))
        b = max(0.0, sum(wt * x * r for wt, (x, r) in zip(weights, over)) / sxx) if sxx > 0 else 0.0
        c, e = fitted or (step - b * width, b)
        return c + e * self._last_rows, b

    def budget(self, cap: int, running: bool) -> int:
        """Prompt tokens for the next step: ``cap`` at most; paced only while ``running`` streams wait (0: a probe)."""
        if not running:
            return cap
        if self._since_plain >= PROBE_EVERY:  # a step without prompt tokens for the fit
            return 0
        line = self.line()
        if line is None or line[1] <= 0:  # the token's cost is measured on what this step feeds
            return min(MIN_PACED_CHUNK, cap)
        a, b = line
        reach = max(MIN_PACED_CHUNK, int(REACH * self._widest))
        return max(min(MIN_PACED_CHUNK, cap), min(cap, reach, int(self.share * a / b)))
