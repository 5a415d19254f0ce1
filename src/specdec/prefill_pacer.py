"""How many prompt tokens a step may feed beside the running streams, from measured time (chunked
prefill's default on a CPU).

A step of the scheduler feeds the prompts' next chunks (their own forwards) and then runs the decoding
step of every running sequence, so each running stream waits ``P(C) + S`` between two tokens: ``S`` the
decoding step, ``P(C)`` the prefill of ``C`` prompt tokens. A fixed token budget cannot bound that ratio
on a CPU, where ``P`` grows with every token fed and ``S`` with the rows running: 128 tokens moved the
embedded pair's p99 inter-token latency 2.3-4.8x (``docs/lab-notes/2026-11-24-serving.md``). The pacer
picks ``C`` so that ``P(C) <= S``, keeping a stream's latency within twice a step without prompts:

- ``S``: a decayed mean of the measured decoding steps (:meth:`PrefillPacer.observe_step`);
- ``P(C) = a + b C``: a line fitted by decayed least squares to the measured prefills
  (:meth:`PrefillPacer.observe_prefill`); until their sizes differ enough for a slope, ``a = 0`` and
  ``b`` is the mean time per token (which overprices small chunks, erring on the side of latency);
- ``C = (S - a) / b``, within ``[MIN_PACED_CHUNK, cap]``, ``cap`` the scheduler's token budget; with no
  stream running (nobody's latency to keep) or before any prefill is measured, ``cap``.

The floor keeps a prompt moving however slow a prefill is: a chunk of ``MIN_PACED_CHUNK`` tokens a step.
"""

from __future__ import annotations

MIN_PACED_CHUNK = 16
"""Prompt tokens a paced step feeds at least (one KV block): the prompt's progress when even that
exceeds a decoding step."""

DECAY = 0.9
"""Weight of the past per new measurement (about the last ten steps and prefills count)."""


class PrefillPacer:
    """The prompt tokens of the next step, from decayed measurements of decoding steps and prefills."""

    def __init__(self) -> None:
        self.step_seconds: float | None = None  # decayed mean decoding step
        # decayed least-squares sums of the prefills: weight, tokens, tokens^2, seconds, tokens * seconds
        self._w = self._x = self._xx = self._y = self._xy = 0.0

    def observe_step(self, seconds: float) -> None:
        """A decoding step over the running sequences took ``seconds``."""
        self.step_seconds = seconds if self.step_seconds is None else DECAY * self.step_seconds + (1 - DECAY) * seconds

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Feeding ``tokens`` prompt tokens (one scheduler step's prefill) took ``seconds``."""
        if tokens <= 0:
            return
        d = DECAY
        self._w, self._x, self._xx = d * self._w + 1, d * self._x + tokens, d * self._xx + tokens * tokens
        self._y, self._xy = d * self._y + seconds, d * self._xy + tokens * seconds

    def line(self) -> tuple[float, float] | None:
        """``(a, b)``: the fitted prefill cost ``a + b C`` seconds (None before a prefill is measured)."""
        if self._w == 0.0:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        if var > (0.25 * mean_x) ** 2:  # chunk sizes spread enough to fit a slope
            b = (self._xy / self._w - mean_x * mean_y) / var
            a = mean_y - b * mean_x
            if b > 0 and a >= 0:
                return a, b
        return 0.0, mean_y / mean_x

    def budget(self, cap: int, running: bool) -> int:
        """Prompt tokens for the next step: ``cap`` at most; paced only while ``running`` streams wait."""
        line = self.line()
        if not running or line is None or self.step_seconds is None:
            return cap
        a, b = line
        fits = int((self.step_seconds - a) / b) if b > 0 else cap
        return max(min(MIN_PACED_CHUNK, cap), min(cap, fits))
