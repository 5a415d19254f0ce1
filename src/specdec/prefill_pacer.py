"""How many prompt tokens a step may feed beside the running streams, from measured time (chunked
prefill's default on a CPU).

A scheduler step that feeds ``C`` prompt tokens beside the decoding step of the running sequences takes
``T(C)`` seconds, and every running stream waits that long between two tokens. The prompt tokens share the
decoding step's forward where the backend fuses them (:mod:`specdec.models.segments`), else they are their
own forwards before it; either way ``T`` grows with every token on a CPU, and a fixed token budget cannot
bound a stream's latency: 128 tokens moved the embedded pair's p99 inter-token latency 2.3-4.8x
(``docs/lab-notes/2026-11-24-serving.md``). The pacer keeps ``T(C) <= (1 + SHARE) T(0)`` with
``T(C) = a + b C``:

- ``a``, the decoding step: a mean of the steps that fed no prompt token, decayed per step;
- ``b``, what a prompt token adds: a decayed mean of ``(T - a) / C`` over the steps that fed ``C > 0``
  tokens within ``FRESH`` steps of one that fed none (so ``a`` is that of the same load; fitting one
  line through all steps would read a load that grew as a cheaper token);
- ``C = SHARE a / b``, within ``[MIN_PACED_CHUNK, cap]``, ``cap`` the scheduler's token budget; with no
  stream running (nobody's latency to keep), ``cap``; while ``b`` is not measured, ``MIN_PACED_CHUNK``
  (whose step measures it: the whole budget would measure it better, but every running stream waits
  through that step, which took 4-5 decoding steps on the embedded pair,
  ``docs/lab-notes/2026-11-28-fused-prefill.md``).

Where prompts wait at every step (a flood, or a saturated server), no step would measure ``a``: so a step
that comes ``PROBE_EVERY`` steps after the last one without prompt tokens (or the first paced one) feeds
none. It costs the prompts one step of progress in ``PROBE_EVERY``, and the streams nothing.

The floor keeps a prompt moving however slow a prefill is: a chunk of ``MIN_PACED_CHUNK`` tokens a step.
"""

from __future__ import annotations

MIN_PACED_CHUNK = 16
"""Prompt tokens a paced step feeds at least (one KV block): the prompt's progress when even that
exceeds the share of a decoding step."""

SHARE = 0.5
"""What the prompt tokens of a paced step may add to it, as a share of a decoding step: a running stream's
inter-token latency stays within 1.5 times a step without prompts (the serving targets allow 2)."""

DECAY = 0.9
"""Weight of the past per new measurement (about the last ten steps count)."""

FRESH = 4
"""Steps after one without prompt tokens whose cost measures a prompt token against it."""

PROBE_EVERY = 16
"""Steps with prompt tokens after which one feeds none, to measure the decoding step under the current load."""


class PrefillPacer:
    """The prompt tokens of the next step, from decayed measurements of the steps' seconds."""

    def __init__(self) -> None:
        self.step_seconds: float | None = None  # a: the decoding step
        self.token_seconds: float | None = None  # b: what a prompt token adds to it
        self._since_plain = PROBE_EVERY  # steps since the last one that fed no prompt token

    def observe(self, tokens: int, seconds: float) -> None:
        """A scheduler step that ran the running streams' decoding step and fed ``tokens`` prompt tokens (0:
        none) took ``seconds``."""
        a, b = self.step_seconds, self.token_seconds
        if tokens == 0:  # the past decays per step, so a probe after a flood's steps weighs more
            keep = DECAY ** (self._since_plain + 1)
            self.step_seconds = seconds if a is None else keep * a + (1 - keep) * seconds
            self._since_plain = 0
            return
        self._since_plain += 1
        if a is not None and self._since_plain <= FRESH:
            sample = max(seconds - a, 0.0) / tokens
            self.token_seconds = sample if b is None else DECAY * b + (1 - DECAY) * sample

    def line(self) -> tuple[float, float] | None:
        """``(a, b)``: the step ``a + b C`` seconds, or None until both were measured."""
        if self.step_seconds is None or self.token_seconds is None:
            return None
        return self.step_seconds, self.token_seconds

    def budget(self, cap: int, running: bool) -> int:
        """Prompt tokens for the next step: ``cap`` at most; paced only while ``running`` streams wait (0: a probe)."""
        if not running:
            return cap
        if self._since_plain >= PROBE_EVERY:  # a step without prompt tokens measures the decoding step
            return 0
        line = self.line()
        if line is None:  # the token's cost is measured on what this step feeds
            return min(MIN_PACED_CHUNK, cap)
        a, b = line
        return max(min(MIN_PACED_CHUNK, cap), min(cap, int(SHARE * a / b))) if b > 0 else cap
