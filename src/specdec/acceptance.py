"""What a row's drafts are worth to :mod:`specdec.adaptive` (``num_speculative_tokens="auto"``): the
conditional :class:`Acceptance` of each draft position, the :class:`ProposalRate` at which a
drafter proposes a draft at all, and :func:`expected_tokens`, the tokens a step emits."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Acceptance:
    """Conditional acceptance per draft position as decayed counts plus ``prior_weight`` pseudo-counts
    of a prior per position given to :meth:`rates` (a sequence's prior: the pool's rates of the step)."""

    max_k: int
    decay: float
    prior_weight: float
    carry: bool = False  # the prior of position i > 0 is the rate of position i - 1 (``prior[0]`` the first's)
    tried: list[float] = field(init=False)  # decayed counts, each divided by ``scale``
    kept: list[float] = field(init=False)
    scale: float = field(init=False)  # decay ** updates (since the counts were last renormalised)

    def __post_init__(self) -> None:
        self.tried = [0.0] * self.max_k
        self.kept = [0.0] * self.max_k
        self.scale = 1.0

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """A step drafted ``num_drafted`` tokens and kept ``num_accepted``: positions up to the first
        rejection were tried, the accepted ones kept. Every count decays by ``decay`` per update; the
        decay is carried by ``scale``, so an update touches only the positions it tried."""
        self.scale *= self.decay
        if self.scale < 1e-100:  # renormalise before the stored counts grow out of range
            self.tried = [t * self.scale for t in self.tried]
            self.kept = [a * self.scale for a in self.kept]
            self.scale = 1.0
        one = 1.0 / self.scale
        for i in range(min(num_drafted, num_accepted + 1, self.max_k)):
            self.tried[i] += one
            if i < num_accepted:
                self.kept[i] += one

    def rates(self, prior: list[float]) -> list[float]:
        """``[max_k]`` conditional acceptance per position, ``prior`` ``[max_k]`` standing in where few were tried."""
        w = self.prior_weight / self.scale  # in the stored counts' units
        if not self.carry:
            return [(a + w * p) / (t + w) for a, t, p in zip(self.kept, self.tried, prior)]
        out = []
        for i, (a, t, p) in enumerate(zip(self.kept, self.tried, prior)):
            out.append((a + w * (out[-1] if i else p)) / (t + w))
        return out


@dataclass
class ProposalRate:
    """How often a row's drafter proposes a draft when asked for one (an n-gram lookup finds no match on
    some steps; a draft model always proposes), as decayed counts plus ``prior_weight`` pseudo-counts
    of a prior given to :meth:`rate`."""

    decay: float
    prior_weight: float
    asked: float = 0.0
    proposed: float = 0.0

    def update(self, proposed: bool) -> None:
        self.asked = self.asked * self.decay + 1.0
        self.proposed = self.proposed * self.decay + proposed

    def rate(self, prior: float) -> float:
        """The probability of a proposal, ``prior`` standing in where few were asked."""
        return (self.proposed + self.prior_weight * prior) / (self.asked + self.prior_weight)


def expected_tokens(rates: list[float], k: int) -> float:
    """``E(k)``: tokens a step emits drafting ``k`` tokens with conditional acceptance ``rates``."""
    total, survive = 1.0, 1.0
    for a in rates[:k]:
        survive *= a
        total += survive
    return total
