"""How many prompt tokens a step may feed beside the running streams, from measured time (chunked
prefill's default on a CPU).

A scheduler step that feeds ``C`` prompt tokens beside the decoding step of the running sequences takes
``T(C)`` seconds, and every running stream waits that long between two tokens. The prompt tokens share the
decoding step's forward where the backend fuses them (:mod:`specdec.models.segments`), else they are their
own forwards before it; either way ``T`` grows with every token on a CPU, and a fixed token budget cannot
bound a stream's latency: 128 tokens moved the embedded pair's p99 inter-token latency 2.3-4.8x
(``docs/lab-notes/2026-11-24-serving.md``). The pacer keeps ``T(C) <= (1 + SHARE) T(0)``
(``SHARE`` by default, else the ``share`` it is given).

The measurement. Each step that ran streams reports its seconds ``T``, the prompt tokens it fed ``C`` and its
decoding tokens ``D`` (one per running row plus the drafts it verified). The pacer fits
``T = c + e D + b C`` by least squares over the recent steps (weights decaying by ``DECAY`` per step):

- ``b``, what a prompt token adds to a step;
- ``a = c + e D_last``, the decoding step at the last step's decoding tokens (with ``D`` not in the fit, below:
  the line of ``T`` against ``C`` alone, :class:`~specdec.step_cost.LineFit`, whose ``b`` is at least 0);
- ``C = SHARE a / b``, within ``[MIN_PACED_CHUNK, cap]``, ``cap`` the scheduler's token budget; with no stream
  running (nobody's latency to keep), ``cap``; while ``b`` is not measured (or measured at 0: on a CPU a prompt
  token always costs something, and the whole budget beside running streams took about five decoding steps at the
  ``1b`` shape, ``docs/lab-notes/2026-11-29-flood.md``), ``MIN_PACED_CHUNK`` (whose step
  measures it: the whole budget would measure it better, but every running stream waits through that step,
  which took 4-5 decoding steps on the embedded pair, ``docs/lab-notes/2026-11-28-fused-prefill.md``).

``D`` is in the fit because the decoding step is not one size. With speculation its width changes from step
to step with the drafts chosen, and more so at saturation, where the steps feeding prompts are those that
run more rows: priced against the mean step without prompts, a prompt token came out 1.5-2x its cost
(eagle at 16 streams on the embedded pair: 1.29 ms against 0.60 ms by this fit; plain decoding 0.63 against
0.74), and the prompts got less than their share of a speculative step: TTFT 3-4.6x plain decoding's, and
throughput 0.8-0.9x (``docs/lab-notes/2026-11-28-pacer-fit.md``). While ``D`` has not varied apart from
``C`` (its share of variance in ``C`` explained above ``COLLINEAR``) or fewer than ``MIN_FIT_STEPS`` steps
were measured, ``b`` comes from ``C`` alone.

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

from specdec.errors import SpecDecError
from specdec.step_cost import LineFit

MIN_PACED_CHUNK = 8
"""Prompt tokens a paced step feeds at least: the prompt's progress when even that exceeds the share of a
decoding step. It was one KV block (16) until 2026-11-29, which overrode the share where it binds: at one
stream on the embedded pair ``SHARE a / b`` is 8-9 tokens, and the floor's 16 doubled every step of a flood
(``docs/lab-notes/2026-11-29-flood.md``)."""

SHARE = 0.5
"""What the prompt tokens of a paced step may add to it by default, as a share of a decoding step: a running
stream's inter-token latency stays within 1.5 times a step without prompts (the serving targets allow 2).
``prefill_share`` (``--prefill-share``) sets another: more lowers the waiting prompts' time to first token and
raises the running streams' inter-token latency (``docs/lab-notes/2026-11-29-prefill-share.md``)."""

DECAY = 0.95
"""Weight of the past per step (about the last twenty steps count, a probe among them)."""

PROBE_EVERY = 16
"""Steps with prompt tokens after which one feeds none, so that the fit sees steps without them."""

REACH = 2
"""How many times the most prompt tokens a recent step fed the next step may feed."""

MIN_FIT_STEPS = 8
"""Steps measured before the decoding tokens enter the fit (three unknowns from a handful of noisy steps)."""

COLLINEAR = 0.95
"""Above this squared correlation of ``D`` and ``C`` the two are not told apart: ``b`` from ``C`` alone."""


def check_prefill_share(value: object) -> float:
    """``value`` as a share of a decoding step once it is one: a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise SpecDecError(f"prefill_share must be a number > 0 (what a step's prompt tokens may add to it, as a "
                           f"share of a decoding step), got {value!r}")
    return float(value)


class PrefillPacer:
    """The prompt tokens of the next step, from a decayed least-squares fit of the steps' seconds;
    ``share``: what they may add to a decoding step, as a share of it (``SHARE`` above)."""

    def __init__(self, share: float = SHARE) -> None:
        self.share = check_prefill_share(share)
        self.fit = LineFit(DECAY)  # T against C, which the decoding tokens' sums below extend
        self._d_sums = [0.0] * 4  # decayed as the fit's: ΣD, ΣD², ΣDC, ΣDT
        self._steps = 0  # steps measured
        self._last_decoding = 0.0  # the decoding tokens of the last step measured
        self._since_plain = PROBE_EVERY  # steps since the last one that fed no prompt token
        self._widest = 0.0  # the most prompt tokens a step fed, decayed as the fit

    def observe(self, tokens: int, decoding: int, seconds: float) -> None:
        """A scheduler step that ran the running streams' ``decoding`` tokens (rows plus drafts) and fed
        ``tokens`` prompt tokens (0: none) took ``seconds``."""
        self._since_plain = 0 if tokens == 0 else self._since_plain + 1
        self._steps += 1
        self._last_decoding = d = float(decoding)
        self._widest = max(float(tokens), self._widest * DECAY)
        self.fit.add(tokens, seconds)
        self._d_sums = [s * DECAY + v for s, v in zip(self._d_sums, (d, d * d, d * tokens, d * seconds))]

    def line(self) -> tuple[float, float] | None:
        """``(a, b)``: the step ``a + b C`` seconds, or None until steps feeding different numbers of prompt
        tokens were measured."""
        if not self.fit.spread:  # C never varied: nothing to price a token by
            return None
        a, b = self.fit.line()  # from C alone (b >= 0)
        w, sum_c, sum_cc, sum_t, sum_ct = self.fit.sums
        sum_d, sum_dd, sum_dc, sum_dt = self._d_sums
        mean_d, mean_c, mean_t = sum_d / w, sum_c / w, sum_t / w
        var_c, var_d = sum_cc / w - mean_c * mean_c, sum_dd / w - mean_d * mean_d
        cov_dc = sum_dc / w - mean_d * mean_c
        det = var_d * var_c - cov_dc * cov_dc
        if self._steps >= MIN_FIT_STEPS and var_d > 0 and det > (1 - COLLINEAR) * var_d * var_c:
            cov_ct, cov_dt = sum_ct / w - mean_c * mean_t, sum_dt / w - mean_d * mean_t
            fitted = (var_d * cov_ct - cov_dc * cov_dt) / det
            if fitted > 0:  # else noise: a prompt token never makes a step shorter (keep the line of C alone)
                e = (var_c * cov_dt - cov_dc * cov_ct) / det  # what a decoding token adds
                a, b = mean_t - fitted * mean_c + e * (self._last_decoding - mean_d), fitted
        return a, b

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
