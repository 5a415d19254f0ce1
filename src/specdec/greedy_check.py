"""Tie-aware comparison of two greedy outputs of one prompt under one target model.

Greedy speculative decoding emits the target's argmax at every position, so its output equals
plain greedy decoding's token for token *when the target's logits are computed exactly*. In
float16/bfloat16 the target's logits at a position depend on the kernel that computed them (a
one-token decode step, a (k+1)-token verification, a prefill), and two logits that are tied, or
one rounding step apart, can swap places: the argmax flips and the two outputs diverge from
there on. That is a rounding tie, not a lossy method.

:func:`check_greedy` finds the first position where two outputs differ, recomputes the target's
logits there (one fresh forward over the prompt and the common prefix) and classifies the
difference: a *tie* when the two differing tokens' logits are within the rounding of the
target's dtype at their magnitude (:func:`rounding_tolerance`), else a real *mismatch*. A
comparison harness fails only on mismatches, and reports the position and the gap either way.
torch is imported when a target runs, so that importing this module stays cheap.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

    from specdec.models.base import CausalLM

ROUNDING_ULPS = 2
"""Logits this many units in the last place (of the target's dtype, at their magnitude) apart
count as a rounding tie: one for the rounding of each path's result."""

Kind = Literal["equal", "tie", "mismatch"]


@dataclass(frozen=True)
class GreedyVerdict:
    """The outcome of comparing two greedy outputs.

    ``kind``: ``"equal"`` (identical lists), ``"tie"`` (they first differ at ``position`` where the
    target's logits of the two tokens are within ``tolerance``) or ``"mismatch"`` (anything else:
    a larger gap, or one output ending where the other goes on). ``position``: index of the first
    difference in the output lists. ``tokens``: ``(expected, actual)`` tokens there (None when one
    list ends there). ``gap``: |logit(expected) - logit(actual)| under the target; ``top2_gap``:
    the target's largest logit minus its second largest there; ``tolerance``: the dtype's rounding
    of those logits. All None for ``"equal"``.
    """

    kind: Kind
    position: int | None = None
    tokens: tuple[int, int] | None = None
    gap: float | None = None
    top2_gap: float | None = None
    tolerance: float | None = None

    @property
    def ok(self) -> bool:
        """Whether the outputs count as identical (equal, or first differing at a rounding tie)."""
        return self.kind != "mismatch"

    def describe(self) -> str:
        """One line for a report, e.g. ``rounding tie at token 12 (logit gap 0 <= 0.0625)``."""
        if self.kind == "equal":
            return "identical"
        if self.tokens is None:
            return f"mismatch at token {self.position}: one output ends there and the other goes on"
        gap = f"logit gap {self.gap:.4g} between tokens {self.tokens[0]} and {self.tokens[1]}"
        if self.kind == "tie":
            return f"rounding tie at token {self.position} ({gap} <= {self.tolerance:.4g})"
        return f"mismatch at token {self.position} ({gap} > {self.tolerance:.4g}, top-2 gap {self.top2_gap:.4g})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def first_difference(expected: Sequence[int], actual: Sequence[int]) -> int | None:
    """The first index where the two lists differ (the shorter one's length when one is a prefix of
    the other), None when they are equal."""
    for index, (a, b) in enumerate(zip(expected, actual)):
        if a != b:
            return index
    return None if len(expected) == len(actual) else min(len(expected), len(actual))


def rounding_tolerance(magnitude: float, dtype: torch.dtype, ulps: float = ROUNDING_ULPS) -> float:
    """``ulps`` units in the last place of ``dtype`` at ``magnitude``: the largest gap between two
    logits of about that size that rounding alone can swap."""
    import torch

    finfo = torch.finfo(dtype)
    if magnitude < finfo.tiny:
        return ulps * finfo.tiny
    return ulps * finfo.eps * 2.0 ** math.floor(math.log2(magnitude))


def next_token_logits(target: CausalLM, context: Sequence[int]) -> torch.Tensor:
    """The target's logits ``[V]`` (in its dtype) for the token after ``context``, from one fresh forward
    in a one-slot cache of its own."""
    import torch

    from specdec.models.base import ForwardBatch

    cache = target.new_cache(1, len(context))
    batch = ForwardBatch.from_rows([list(context)], [0], [0], target.device, logits="last")
    with torch.no_grad():
        return target.forward(batch, cache).logits[0]


def check_greedy(
    target: CausalLM,
    prompt_ids: Sequence[int],
    expected: Sequence[int],
    actual: Sequence[int],
    ulps: float = ROUNDING_ULPS,
    adjust: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None,
) -> GreedyVerdict:
    """Compare two greedy outputs of ``prompt_ids`` under ``target`` (e.g. ``LLM(...).target``).

    ``expected`` is the reference (plain greedy decoding), ``actual`` the output checked; both are
    lists of generated token ids (prompt excluded). Equal lists are ``"equal"`` without running the
    target. Otherwise the target runs once over ``prompt_ids + expected[:position]`` and the verdict
    carries the logit gap of the two differing tokens, the top-2 gap and the tolerance; it is a
    ``"tie"`` when ``gap <= rounding_tolerance(max(|logits of the two|), target.dtype, ulps)``. ``adjust``:
    the logits there ``[V]`` and the output before them to the logits greedy decoding took the argmax of (the
    request's penalties, :func:`specdec.penalties.adjusted_position`).
    """
    position = first_difference(expected, actual)
    if position is None:
        return GreedyVerdict("equal")
    if position >= min(len(expected), len(actual)):
        return GreedyVerdict("mismatch", position)
    a, b = int(expected[position]), int(actual[position])
    logits = next_token_logits(target, [*prompt_ids, *expected[:position]]).double()
    if adjust is not None:
        logits = adjust(logits, list(expected[:position]))
    la, lb = logits[a].item(), logits[b].item()
    top2 = logits.topk(2).values
    gap = abs(la - lb)
    tolerance = rounding_tolerance(max(abs(la), abs(lb)), target.dtype, ulps)
    kind: Kind = "tie" if gap <= tolerance else "mismatch"
    return GreedyVerdict(kind, position, (a, b), gap, (top2[0] - top2[1]).item(), tolerance)
