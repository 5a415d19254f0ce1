"""How many prompt tokens a step may feed beside the running streams, from measured time (chunked
prefill's default on a CPU).

A scheduler step that feeds ``C`` prompt tokens beside the decoding step of the running sequences takes
``T(C)`` seconds, and every running stream waits that long between two tokens. The prompt tokens share the
decoding step's forward where the backend fuses them (:mod:`specdec.models.segments`), else they are their
own forwards before it; either way ``T`` grows with every token on a CPU, and a fixed token budget cannot
bound a stream's latency: 128 tokens moved the embedded pair's p99 inter-token latency 2.3-4.8x
(``docs/lab-notes/2026-11-24-serving.md``). The pacer keeps ``T(C) <= (1 + SHARE) T(0)``.

The measurement. Each step that ran streams reports its seconds ``T``, the prompt tokens it fed ``C`` and its
decoding tokens ``D`` (one per running row plus the drafts it verified). The pacer fits
``T = c + e D + b C`` by least squares over the recent steps (weights decaying by ``DECAY`` per step):

- ``b``, what a prompt token adds to a step;
- ``a = c + e D_last``, the decoding step at the last step's decoding tokens (with ``e`` not fitted, below:
  ``mean(T) - b mean(C)``, the mean step with its prompt tokens taken out);
- ``C = SHARE a / b``, within ``[MIN_PACED_CHUNK, cap]``, ``cap`` the scheduler's token budget; with no stream
  running (nobody's latency to keep), ``cap``; while ``b`` is not measured, ``MIN_PACED_CHUNK`` (whose step
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
"""

from __future__ import annotations

MIN_PACED_CHUNK = 16
"""Prompt tokens a paced step feeds at least (one KV block): the prompt's progress when even that
exceeds the share of a decoding step."""

SHARE = 0.5
"""What the prompt tokens of a paced step may add to it, as a share of a decoding step: a running stream's
inter-token latency stays within 1.5 times a step without prompts (the serving targets allow 2)."""

DECAY = 0.95
"""Weight of the past per step (about the last twenty steps count, a probe among them)."""

PROBE_EVERY = 16
"""Steps with prompt tokens after which one feeds none, so that the fit sees steps without them."""

MIN_FIT_STEPS = 8
"""Steps measured before the decoding tokens enter the fit (three unknowns from a handful of noisy steps)."""

COLLINEAR = 0.95
"""Above this squared correlation of ``D`` and ``C`` the two are not told apart: ``b`` from ``C`` alone."""


class PrefillPacer:
    """The prompt tokens of the next step, from a decayed least-squares fit of the steps' seconds."""

    def __init__(self) -> None:
        # decayed sums over the steps: weight, then of D, C, T and their products
        self._w = self._d = self._c = self._t = 0.0
        self._dd = self._dc = self._cc = self._dt = self._ct = 0.0
        self._steps = 0  # steps measured
        self._last_decoding = 0.0  # the decoding tokens of the last step measured
        self._since_plain = PROBE_EVERY  # steps since the last one that fed no prompt token

    def observe(self, tokens: int, decoding: int, seconds: float) -> None:
        """A scheduler step that ran the running streams' ``decoding`` tokens (rows plus drafts) and fed
        ``tokens`` prompt tokens (0: none) took ``seconds``."""
        self._since_plain = 0 if tokens == 0 else self._since_plain + 1
        self._steps += 1
        self._last_decoding = float(decoding)
        d, c, t = float(decoding), float(tokens), seconds
        self._w = DECAY * self._w + 1.0
        self._d, self._c, self._t = DECAY * self._d + d, DECAY * self._c + c, DECAY * self._t + t
        self._dd, self._dc, self._cc = DECAY * self._dd + d * d, DECAY * self._dc + d * c, DECAY * self._cc + c * c
        self._dt, self._ct = DECAY * self._dt + d * t, DECAY * self._ct + c * t

    def line(self) -> tuple[float, float] | None:
        """``(a, b)``: the step ``a + b C`` seconds, or None until a step without prompt tokens and one with
        them were measured."""
        w = self._w
        if w == 0.0:
            return None
        mean_d, mean_c, mean_t = self._d / w, self._c / w, self._t / w
        var_c = self._cc / w - mean_c * mean_c
        if var_c <= 1e-9 * max(1.0, mean_c * mean_c):  # C never varied: nothing to price a token by
            return None
        cov_ct = self._ct / w - mean_c * mean_t
        b = cov_ct / var_c
        var_d = self._dd / w - mean_d * mean_d
        cov_dc = self._dc / w - mean_d * mean_c
        det = var_d * var_c - cov_dc * cov_dc
        e = 0.0  # what a decoding token adds
        if self._steps >= MIN_FIT_STEPS and var_d > 0 and det > (1 - COLLINEAR) * var_d * var_c:
            cov_dt = self._dt / w - mean_d * mean_t
            b = (var_d * cov_ct - cov_dc * cov_dt) / det
            e = (var_c * cov_dt - cov_dc * cov_ct) / det
        return mean_t - b * mean_c + e * (self._last_decoding - mean_d), b

    def budget(self, cap: int, running: bool) -> int:
        """Prompt tokens for the next step: ``cap`` at most; paced only while ``running`` streams wait (0: a probe)."""
        if not running:
            return cap
        if self._since_plain >= PROBE_EVERY:  # a step without prompt tokens for the fit
            return 0
        line = self.line()
        if line is None:  # the token's cost is measured on what this step feeds
            return min(MIN_PACED_CHUNK, cap)
        a, b = line
        return max(min(MIN_PACED_CHUNK, cap), min(cap, int(SHARE * a / b))) if b > 0 else cap
