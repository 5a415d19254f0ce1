"""``num_speculative_tokens="auto"``: the k policy on synthetic figures, and losslessness with it.

The policy tests feed :mod:`specdec.adaptive` made-up acceptance and step times and check that it
picks the k that S(k) = (1 − α^(k+1)) / ((1 − α)(kc + 1)) says, switches speculation off where the
predicted speedup is below 1 (low acceptance, or a verification forward whose cost grows with its
tokens, as at a large batch on CPU), and gives better rows longer drafts. The engine tests check
greedy equality and sampling exactness with auto k and with the draft's confidence stop.
"""

import math
import random
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from helpers import spy
from test_sampling_exactness import BATCH, assert_matches_target
from transformers import AutoModelForCausalLM

from specdec import LLM, SamplingParams, adaptive
from specdec.acceptance import Acceptance, expected_tokens
from specdec.adaptive import HOLD_MAX, PRIOR_ACCEPTANCE, AdaptiveK, choose_ks
from specdec.errors import SpecDecError
from specdec.k_schedule import FixedK
from specdec.metrics import BatchMetrics, RequestMetrics
from specdec.step_cost import CostModel, StepCost

MAX_K = 8


def formula(alpha: float, k: int, c: float) -> float:
    """S(k) of the issue (S(0) = 1: plain decoding)."""
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))


@pytest.mark.parametrize("alpha", [0.3, 0.55, 0.7, 0.8, 0.9, 0.97])
@pytest.mark.parametrize("c", [0.02, 0.1, 0.25, 0.6])
def test_single_row_picks_the_formulas_k(alpha, c):
    """Batch 1, a flat target cost (verification free) and draft cost c per position: argmax S(k)."""
    ks, speedup = choose_ks([[alpha] * MAX_K], [MAX_K], CostModel(intercept=1.0, slope=0.0, draft=c))
    scores = [formula(alpha, k, c) for k in range(MAX_K + 1)]
    assert ks == [int(np.argmax(scores))]
    assert speedup == pytest.approx(max(scores))


def test_speculation_off_below_one():
    """α = 0.2 and c = 0.5: every S(k) < 1, so no drafts and a predicted speedup of exactly 1."""
    assert max(formula(0.2, k, 0.5) for k in range(1, MAX_K + 1)) < 1
    ks, speedup = choose_ks([[0.2] * MAX_K], [MAX_K], CostModel(1.0, 0.0, 0.5))
    assert ks == [0] and speedup == 1.0


def test_expected_tokens_generalises_the_formula():
    assert expected_tokens([0.6] * 5, 5) == pytest.approx((1 - 0.6**6) / 0.4)
    assert expected_tokens([0.9, 0.5, 0.1], 3) == pytest.approx(1 + 0.9 + 0.45 + 0.045)
    assert expected_tokens([0.9, 0.5], 0) == 1.0


def test_batch_where_verification_is_not_free_turns_speculation_off():
    """32 rows at α = 0.8: with a flat target cost they draft; when each extra token costs as much as
    a row (compute-bound verification), E(k) / (k + 1) < 1 and they do not."""
    rates, limits = [[0.8] * MAX_K] * 32, [MAX_K] * 32
    free, speedup = choose_ks(rates, limits, CostModel(1.0, 0.0, 0.01))
    assert all(k > 0 for k in free) and speedup > 2
    bound, speedup = choose_ks(rates, limits, CostModel(0.0, 1.0, 0.01))
    assert bound == [0] * 32 and speedup == 1.0
    # In between (verification a little dearer per token than free), fewer drafts than when free.
    some, _ = choose_ks(rates, limits, CostModel(8.0, 0.1, 0.01))
    assert 0 < sum(some) < sum(free)


def test_better_rows_draft_more():
    ks, _ = choose_ks([[0.95] * MAX_K, [0.5] * MAX_K, [0.05] * MAX_K], [MAX_K, MAX_K, 2],
                      CostModel(1.0, 0.05, 0.05))
    assert ks[0] > ks[1] > ks[2] == 0
    assert choose_ks([[0.9] * MAX_K], [3], CostModel(1.0, 0.0, 0.01))[0] == [3]  # the row's limit holds


def test_padded_grid_drafts_every_row_to_the_width():
    """A backend that pads rows to the longest (the fast backend's grid) costs ``rows x (w + 1)``
    tokens whatever each row drafts: every row then drafts up to the chosen width, and the predicted
    speedup charges the padded cells."""
    rates, limits = [[0.95] * MAX_K, [0.5] * MAX_K, [0.05] * MAX_K], [MAX_K, MAX_K, 2]
    cost = CostModel(1.0, 0.05, 0.05)
    ks, speedup = choose_ks(rates, limits, cost, padded=True)
    width = max(ks)
    assert width > 0 and ks == [min(width, limit) for limit in limits]
    tokens = 3 + sum(expected_tokens(r, k) - 1 for r, k in zip(rates, ks))
    assert speedup == pytest.approx(tokens / cost.seconds(3 * (width + 1), width) / (3 / cost.seconds(3, 0)))
    # 16 rows, one of them good: unpadded it drafts alone; padded, its drafts would cost 16 rows of cells.
    rates, limits = [[0.9] * MAX_K] + [[0.05] * MAX_K] * 15, [MAX_K] * 16
    assert choose_ks(rates, limits, CostModel(8.0, 0.1, 0.0))[0][0] > 0
    assert choose_ks(rates, limits, CostModel(8.0, 0.1, 0.0), padded=True) == ([0] * 16, 1.0)


@pytest.mark.parametrize(("rows", "padded"), [(1, False), (16, False), (16, True)])
def test_prompt_tokens_in_the_step_are_work_the_drafts_must_not_slow(rows, padded):
    """A step that also feeds prompt tokens (chunked prefill) is priced by its work per second, emitted and prompt
    tokens alike. Where each token costs about as much as the step's mean (the step's tokens already fill the
    machine), drafts that pay for the rows alone no longer pay beside 40 prompt tokens; where verification is
    free and drafting cheap, they still do. The predicted speedup is the whole step's."""
    rates, limits = [[0.6] * MAX_K] * rows, [MAX_K] * rows
    dear = CostModel(intercept=0.15, slope=0.0017, draft=0.02)  # a token 1.7 ms, a draft position 20 ms
    alone, speedup = choose_ks(rates, limits, dear, padded)
    assert any(alone) and speedup > 1
    assert choose_ks(rates, limits, dear, padded, prompt_tokens=40) == ([0] * rows, 1.0)
    cheap = CostModel(intercept=0.15, slope=0.0, draft=0.002)
    ks, speedup = choose_ks(rates, limits, cheap, padded, prompt_tokens=40)
    assert any(ks) and speedup > 1
    plain = (rows + 40) / cheap.target_seconds(rows + 40)
    assert speedup == pytest.approx(step_rate(rates, ks, cheap, padded, prompt_tokens=40) / plain)


def step_rate(rates: list[list[float]], ks: list[int], cost: CostModel, padded: bool,
              proposing: list[float] | None = None, prompt_tokens: int = 0) -> float:
    """Predicted tokens per second of drafting ``ks``, row ``b`` proposing with probability ``proposing[b]``:
    one row is a drafting step or (nothing proposed) a plain one; many rows feed their expected number
    of tokens, the cost between whole numbers interpolated; ``prompt_tokens`` fed besides count as tokens
    and cost as tokens fed."""
    rows, width, extra = len(ks), max(ks), prompt_tokens
    p = proposing or [1.0] * rows
    tokens = rows + extra + sum(q * (expected_tokens(r, k) - 1) for q, r, k in zip(p, rates, ks))
    if rows == 1 and width:
        return tokens / (p[0] * cost.seconds(1 + ks[0] + extra, width) + (1 - p[0]) * cost.seconds(1 + extra, 0))
    if padded or not width:
        return tokens / cost.seconds((rows * (width + 1) if padded else rows) + extra, width)
    fed = rows + extra + sum(q * k for q, k in zip(p, ks))
    low = math.floor(fed)
    target = cost.target_seconds(low) + (fed - low) * (cost.target_seconds(low + 1) - cost.target_seconds(low))
    return tokens / cost.with_drafting(target, width)


def worst_step(ks: list[int], cost: CostModel, padded: bool, prompt_tokens: int = 0) -> float:
    """Seconds of a step drafting ``ks`` when every row proposes its whole draft, ``prompt_tokens`` fed besides."""
    rows, width = len(ks), max(ks)
    return cost.seconds((rows * (width + 1) if padded else rows + sum(ks)) + prompt_tokens, width)


@pytest.mark.parametrize("padded", [False, True])
def test_choose_ks_equals_scoring_every_width_and_count(padded):
    """Against every choice of the best ``m`` positions up to a width scored (each at its own width),
    with random acceptance, limits and costs (offsets included), in half the cases a bound on the
    step's time (``max_step_ratio``: choices whose step, every row proposing, costs more plain steps of the rows
    alone are left out) and in a third prompt tokens fed besides (priced as work, and counted in the step the
    bound applies to): the same best rate, and ks that reach it within the bound."""
    rng = random.Random(11)
    for _ in range(300):
        rows, max_k = rng.randint(1, 5), rng.randint(1, 10)
        rates = [[rng.choice([rng.random(), 1.0, 0.5]) for _ in range(max_k)] for _ in range(rows)]
        limits = [rng.randint(0, max_k) for _ in range(rows)]
        offsets = tuple(sorted((n, rng.uniform(-0.3, 0.3)) for n in rng.sample(range(1, 60), 4)))
        cost = CostModel(1.0, rng.choice([0.0, 0.02, 0.3]), rng.choice([0.0, 0.01, 0.2]), rng.choice([0.0, 0.1]),
                         rng.uniform(0.8, 1.5), offsets)
        proposing = rng.choice([None, [rng.uniform(0.2, 1.0) for _ in range(rows)]])
        bound = rng.choice([None, rng.uniform(1.0, 2.0)])  # max_step_ratio
        prompt = rng.choice([0, 0, rng.randint(1, 30)])
        gains = sorted((-math.prod(rates[b][: i + 1]), i + 1, b) for b in range(rows) for i in range(limits[b]))
        plain = step_rate(rates, [0] * rows, cost, padded, proposing, prompt)
        best = plain
        for w in range(1, max(limits, default=0) + 1):
            usable = [g for g in gains if g[1] <= w]
            for m in range(1, len(usable) + 1):
                ks = [0] * rows
                for _, _, b in usable[:m]:
                    ks[b] += 1
                if bound is None or worst_step(ks, cost, padded, prompt) <= bound * cost.target_seconds(rows):
                    best = max(best, step_rate(rates, ks, cost, padded, proposing, prompt))
        ks, speedup = choose_ks(rates, limits, cost, padded, proposing, bound, prompt)
        assert all(0 <= k <= limit for k, limit in zip(ks, limits))
        if bound is not None and any(ks):
            assert worst_step(ks, cost, padded, prompt) <= bound * cost.target_seconds(rows) * (1 + 1e-12)
        assert step_rate(rates, ks, cost, padded, proposing, prompt) == pytest.approx(best, rel=1e-9)
        assert speedup == pytest.approx(best / plain, rel=1e-9)


def bernoulli_accepted(ks: list[int], alpha: float, rng: random.Random) -> list[int]:
    """Accepted drafts per row when each of a row's ``k`` drafts is accepted with probability ``alpha``,
    in order, until the first rejection."""
    accepted = []
    for k in ks:
        a = 0
        while a < k and rng.random() < alpha:
            a += 1
        accepted.append(a)
    return accepted


@dataclass
class FakeSeq:
    request_id: str
    metrics: RequestMetrics = field(default_factory=RequestMetrics)


def simulate(alpha: float, step_seconds, steps: int = 400, rows: int = 1, seed: int = 0,
             max_k: int = MAX_K, max_step_ratio: float | None = None) -> list[list[int]]:
    """Run :class:`AdaptiveK` against Bernoulli(α) acceptance and a synthetic clock
    ``step_seconds(num_tokens, width) -> (target, draft)``; returns the ks chosen at each step."""
    policy, rng = AdaptiveK(max_k, max_step_ratio=max_step_ratio), random.Random(seed)
    seqs = [FakeSeq(str(b)) for b in range(rows)]
    chosen = []
    for _ in range(steps):
        ks = policy.choose(seqs, [max_k] * rows)
        accepted = bernoulli_accepted(ks, alpha, rng)
        width = max(ks)
        target, draft = step_seconds(rows + sum(ks), width)
        policy.observe(seqs, ks, accepted, StepCost(rows + sum(ks), width, target, draft))
        chosen.append(ks)
    return chosen


def test_no_drafts_while_prompts_wait_past_the_step():
    """A prompt backlog (tokens left to feed after this step) turns the step's drafts off, probes included, and the
    choice is counted as speculation off; with no backlog the same rows draft again."""
    policy, metrics = AdaptiveK(4), BatchMetrics()
    policy.bind_metrics(metrics)
    seqs = [FakeSeq(str(b)) for b in range(4)]
    rng = random.Random(1)
    for _ in range(40):
        ks = policy.choose(seqs, [4] * 4)
        fed = 4 + sum(ks)
        policy.observe(seqs, ks, bernoulli_accepted(ks, 0.9, rng), StepCost(fed, max(ks), 0.1 + 0.0001 * fed,
                                                                            0.001 * max(ks)))
    assert any(policy.choose(seqs, [4] * 4))
    off = metrics.num_speculation_off_steps
    assert all(policy.choose(seqs, [4] * 4, prompt_tokens=32, prompt_backlog=100) == [0] * 4 for _ in range(40))
    assert metrics.num_speculation_off_steps == off + 40
    assert sum(any(policy.choose(seqs, [4] * 4, prompt_tokens=8)) for _ in range(4)) >= 3  # a probe at most


def saturated(fused: bool, steps: int = 300, prompt_tokens: int = 32, rows: int = 16) -> list[int]:
    """A server warmed up on one row, then saturated: 16 rows, every step feeding 32 prompt tokens (in its own
    forward where ``fused``). The clock: 100 ms, flat up to 8 tokens (memory-bound), then 2.5 ms a token; 15 ms a
    draft position; α = 0.7. Returns the tokens drafted at each saturated step."""
    policy, rng = AdaptiveK(4), random.Random(3)

    def clock(tokens: int) -> float:
        return 0.1 + 0.0025 * max(0, tokens - 8)

    one = [FakeSeq("warm")]
    for _ in range(60):
        ks = policy.choose(one, [4])
        policy.observe(one, ks, bernoulli_accepted(ks, 0.7, rng), StepCost(1 + ks[0], ks[0], clock(1 + ks[0]),
                                                                        0.015 * ks[0]))
    seqs, drafted = [FakeSeq(str(b)) for b in range(rows)], []
    for _ in range(steps):
        ks = policy.choose(seqs, [4] * rows, prompt_tokens=prompt_tokens)
        fed, width = rows + sum(ks), max(ks)
        step = StepCost(fed, width, clock(fed + prompt_tokens), 0.015 * width, prompt_tokens, prompt_fused=fused)
        policy.observe(seqs, ks, bernoulli_accepted(ks, 0.7, rng), step)
        drafted.append(sum(ks))
    return drafted


def test_a_saturated_server_learns_its_cost_from_the_steps_that_feed_prompts():
    """At saturation every step feeds prompts. A step that feeds them in its forward is a point of the cost line
    over all its tokens: the policy learns that a token costs 2.5 ms there, so 16 rows beside 32 prompt tokens
    stay plain (one position a row: 59.2 tokens of work in 275 ms against 48 in 220). Fed apart (another
    forward, so no point of the line), only the warm-up's flat steps price the drafts, which then look free."""
    fused = saturated(True)[100:]
    assert sum(1 for n in fused if n == 0) > 0.85 * len(fused), fused
    apart = saturated(False)[100:]
    assert sum(1 for n in apart if n > 0) > 0.85 * len(apart), apart


@pytest.mark.parametrize("proposing, widths", [(1.0, (4, 6)), (0.5, (2, 3))])
def test_policy_learns_how_often_a_drafter_proposes(proposing, widths):
    """16 rows on a padded grid (a row without a draft costs the step's width too), 8 ms + 0.2 ms a
    token fed, α = 0.9. Rows that always propose are worth drafting 5 or 6 wide (4 is 1% behind);
    rows whose drafter proposes on half the steps (an n-gram lookup without a match) emit nothing
    extra on the other half, and the best width is 3 (2 is 1.2% behind). Without the proposal rate
    the policy would draft the second as wide as the first."""
    rng, rows = random.Random(5), 16
    policy = AdaptiveK(MAX_K, padded=True)
    seqs = [FakeSeq(str(b)) for b in range(rows)]
    chosen = []
    for _ in range(500):
        ks = policy.choose(seqs, [MAX_K] * rows)
        drafted = [k if rng.random() < proposing else 0 for k in ks]
        accepted = []
        for n in drafted:
            a = 0
            while a < n and rng.random() < 0.9:
                a += 1
            accepted.append(a)
        width = max(drafted)
        fed = rows * (width + 1)
        policy.observe(seqs, drafted, accepted, StepCost(fed, width, 0.008 + 0.0002 * fed, 0.0))
        chosen.append(max(ks))
    late = Counter(chosen[200:])
    assert sum(late[w] for w in range(widths[0], widths[1] + 1)) > 0.75 * 300, late  # probes take the rest
    assert policy.pool_proposals.rate(1.0) == pytest.approx(proposing, abs=0.05)


def test_policy_learns_the_formulas_k_from_measurements():
    """α = 0.8, flat target time 10 ms, draft 1 ms per position (c = 0.1): S peaks at k = 6 (a broad
    peak: S(4..8) within 3%); the policy, learning α and c online, drafts 4..8 on nearly every step."""
    chosen = simulate(0.8, lambda n, w: (0.010, 0.001 * w))[100:]
    assert int(np.argmax([formula(0.8, k, 0.1) for k in range(MAX_K + 1)])) == 6
    assert np.mean([4 <= ks[0] <= 8 for ks in chosen]) > 0.85


@pytest.mark.parametrize("rows", [1, 4])
def test_a_step_time_bound_drafts_the_best_k_within_it(rows):
    """α = 0.8, a target of 10 ms + 0.1 ms a token fed, drafting 1 ms a position. Unbounded, the policy
    drafts 4..8 a row (steps of 1.4-1.8 plain steps); with ``max_step_ratio`` 1.3 it drafts 2 a row on
    nearly every step (1.22 plain steps at one row, 1.27 at four; a third position would cost 1.33 at
    one row, 1.38 at four) and never more once the cost is measured: the best choice within the bound,
    as S(k) still climbs at k = 2."""
    clock = lambda n, w: (0.010 + 0.0001 * n, 0.001 * w)  # noqa: E731
    free = simulate(0.8, clock, rows=rows)[100:]
    assert np.mean([min(ks) >= 4 for ks in free]) > 0.85
    bounded = simulate(0.8, clock, rows=rows, max_step_ratio=1.3)
    assert max(max(ks) for ks in bounded[10:]) == 2
    assert np.mean([ks == [2] * rows for ks in bounded[100:]]) > 0.85
    plain = clock(rows, 0)[0]
    assert all(sum(clock(rows + sum(ks), max(ks))) <= 1.3 * plain for ks in bounded[10:])


def test_under_a_bound_drafts_widen_one_position_past_the_widest_measured():
    """Nearly free drafts (a flat 10 ms target, 0.1 ms a position), α = 0.9, a bound of 1.3 plain steps:
    every width up to 8 is within it, and unbounded the policy drafts 8 from its first choice on. Under the
    bound it never drafts more than one position past the widest step timed so far (the first step of
    each shape is not timed), so it widens step by step, and still reaches 8."""
    clock = lambda n, w: (0.010, 0.0001 * w)  # noqa: E731
    assert simulate(0.9, clock, steps=20)[4] == [MAX_K]  # cold start: 8, 8, then plain twice; then the model's 8
    chosen = [ks[0] for ks in simulate(0.9, clock, steps=200, max_step_ratio=1.3)]
    for step, k in enumerate(chosen):
        earlier = chosen[:step]
        timed = [w for w in set(earlier) if earlier.count(w) >= 2]  # a width's second step is timed
        assert k <= max(timed, default=0) + 1, (step, chosen[: step + 1])
    assert chosen[-50:].count(MAX_K) > 40


def test_a_row_near_its_end_starts_no_hold_the_next_request_would_inherit():
    """Nearly free drafts (0.2 ms a position), a target of 10 ms + 0.5 ms a token fed, α = 0.95 and a bound
    of 1.3 plain steps: 4 positions are the most within it. A request at its last draftable token (limit 1)
    gets its whole limit, far ahead of plain decoding; the next request at that row count must not
    inherit that as a held "every row at its most" decision, which would draft 8, far over the bound."""
    policy, rng = AdaptiveK(MAX_K, max_step_ratio=1.3), random.Random(3)
    clock = lambda n, w: (0.010 + 0.0005 * n, 0.0002 * w)  # noqa: E731

    def step(seq: FakeSeq, limit: int) -> list[int]:
        ks = policy.choose([seq], [limit])
        accepted = bernoulli_accepted(ks, 0.95, rng)
        policy.observe([seq], ks, accepted, StepCost(1 + ks[0], ks[0], *clock(1 + ks[0], ks[0])))
        return ks

    chosen = []
    for r in range(6):
        seq = FakeSeq(f"r{r}")
        chosen += [step(seq, MAX_K)[0] for _ in range(60)]
        assert step(seq, 1) == [1]  # its last token
    assert max(chosen[40:]) == 4 and chosen[-100:].count(4) > 80


def test_policy_charges_a_fixed_drafting_cost_per_step_not_per_position():
    """Drafting 5 ms per step plus 0.5 ms per position (a draft model's catch-up forward), flat target 10 ms,
    α = 0.8: the fitted ``(d_0, d)`` is the clock's, and the policy drafts long (S(8) > S(4) by 15% with a
    fixed part; a cost per position alone, the mean 1.75 ms at width 4, would have it draft about 4)."""
    clock = lambda n, w: (0.010, 0.005 + 0.0005 * w)  # noqa: E731
    chosen = simulate(0.8, clock)[100:]
    assert np.mean([ks[0] >= 7 for ks in chosen]) > 0.6
    policy = AdaptiveK(MAX_K)
    seqs = [FakeSeq("a")]
    for step in range(60):
        width = 1 + step % MAX_K
        policy.observe(seqs, [width], [0], StepCost(1 + width, width, 0.010, clock(0, width)[1]))
    fixed, per_position = policy.draft_cost()
    assert fixed == pytest.approx(0.005, rel=1e-6) and per_position == pytest.approx(0.0005, rel=1e-6)


def test_policy_finds_the_step_in_a_staircase_cost():
    """Free drafts, α = 0.95, a target that costs 0.1 ms per token fed but 3 ms more from 17 tokens on
    (a kernel's tile, a CUDA graph bucket): at most 16 drafts, 15 (16 tokens) is fastest by 12%. The
    line fitted through plain and 16-draft steps cannot see the step; the narrower probe measures
    16 tokens, and the policy drafts 15 on most steps (it drafted 16 on most before shapes were measured)."""
    clock = lambda n, w: (0.010 + 0.0001 * n + (0.003 if n > 16 else 0.0), 0.0)  # noqa: E731
    chosen = simulate(0.95, clock, steps=600, max_k=16)[200:]
    assert np.mean([ks[0] == 15 for ks in chosen]) > 0.8


@pytest.mark.parametrize("per_position,held", [(0.00005, True), (0.0005, False)])
def test_a_decision_of_every_row_at_its_most_is_held_far_ahead_where_drafts_cost_nothing(
        monkeypatch, per_position, held):
    """Far ahead with every row at its most (α = 0.95) and drafts next to free (8 positions: 4% of a
    plain step), the policy scores the choice on one step in ``HOLD_MAX`` or so, not on every step, and
    drafts the most on nearly every other step (the probes apart); when drafting turns slow (5 target
    steps a position), it stops drafting within a few holds. With drafts that cost 40% of a plain step
    (a draft model), every step is decided."""
    scored = []
    monkeypatch.setattr(adaptive, "choose_ks", lambda *args: scored.append(1) or choose_ks(*args))
    policy, rng, seqs = AdaptiveK(MAX_K), random.Random(5), [FakeSeq("a")]

    def run(draft_seconds: float, steps: int) -> list[int]:
        chosen = []
        for _ in range(steps):
            k = policy.choose(seqs, [MAX_K])[0]
            a = 0
            while a < k and rng.random() < 0.95:
                a += 1
            policy.observe(seqs, [k], [a], StepCost(1 + k, k, 0.010 + 0.0001 * (1 + k), draft_seconds * k))
            chosen.append(k)
        return chosen

    run(per_position, 200)
    scored.clear()
    far = run(per_position, 400)
    assert sum(k == MAX_K for k in far) > 0.95 * 400
    if not held:
        assert len(scored) > 0.95 * 400
        return
    assert len(scored) < 400 / 4
    slow = run(0.05, 200)[4 * HOLD_MAX :]
    assert sum(k == 0 for k in slow) > 0.85 * len(slow)


def test_cost_model_moves_the_line_by_the_measured_offsets():
    """A shape measured takes its own offset; one not measured, the offset of the largest measured shape
    below it; below the first, the line."""
    cost = CostModel(1.0, 0.1, 0.0, offsets=((3, -0.5), (6, 2.0)))
    curve = [1.1, 1.2, 0.8, 0.9, 1.0, 3.6, 3.7]  # 1..7 tokens
    assert cost.target_curve(1, 7) == pytest.approx(curve)
    assert [cost.target_seconds(n) for n in range(1, 8)] == pytest.approx(curve)
    assert cost.target_curve(4, 6) == pytest.approx(curve[3:6])


def test_acceptance_counts_decay_per_update_over_thousands_of_updates():
    """The decay carried by a scale (renormalised past 1e-100) gives the rates of counts decayed one
    update at a time, across renormalisations (5,000 updates at decay 0.9: about two)."""
    rng = random.Random(3)
    estimate = Acceptance(MAX_K, 0.9, prior_weight=2.0)
    tried, kept = [0.0] * MAX_K, [0.0] * MAX_K
    for step in range(5000):
        drafted = rng.randint(1, MAX_K)
        accepted = rng.randint(0, drafted)
        estimate.update(drafted, accepted)
        tried, kept = [t * 0.9 for t in tried], [a * 0.9 for a in kept]
        for i in range(min(drafted, accepted + 1)):
            tried[i] += 1.0
            kept[i] += i < accepted
        if step % 997 == 0 or step == 4999:
            prior = [rng.random() for _ in range(MAX_K)]
            expected = [(a + 2.0 * p) / (t + 2.0) for a, t, p in zip(kept, tried, prior)]
            assert estimate.rates(prior) == pytest.approx(expected, rel=1e-9)


def test_untried_positions_lean_on_the_position_before():
    """The pool's prior for a position with no tries is the measured rate before it, not the constant
    prior: after drafts that were all accepted at k = 3, positions 4.. are predicted near position 3's rate."""
    policy = AdaptiveK(MAX_K)
    for _ in range(50):
        policy.pool.update(3, 3)
    rates = policy.pool.rates(policy.prior)
    assert min(rates[:3]) > 0.97 and min(rates[3:]) > 0.95
    flat = Acceptance(MAX_K, 0.99, prior_weight=1.0)
    for _ in range(50):
        flat.update(3, 3)
    prior = [PRIOR_ACCEPTANCE] * MAX_K
    assert flat.rates(prior)[3:] == pytest.approx(prior[3:])  # what the carried prior avoids


def test_policy_switches_off_with_low_acceptance_and_with_costly_verification():
    low = simulate(0.1, lambda n, w: (0.010, 0.003 * w))[100:]
    assert np.mean([ks[0] == 0 for ks in low]) > 0.85  # only the periodic probes draft
    # 16 rows, α = 0.7 but every token of the target forward costs 1 ms: off, though drafting is free.
    costly = simulate(0.7, lambda n, w: (0.001 * n, 0.0), rows=16)[100:]
    assert np.mean([sum(ks) == 0 for ks in costly]) > 0.85
    cheap = simulate(0.7, lambda n, w: (0.010 + 0.00001 * n, 0.0), rows=16)[100:]
    assert np.mean([sum(ks) >= 32 for ks in cheap]) > 0.85


@pytest.mark.parametrize("proposing", [1.0, 0.7])
def test_a_plain_step_of_a_drafter_without_a_proposal_takes_the_plain_probes_place(proposing):
    """One row, free drafts, α = 0.9, 10 ms + 0.1 ms a token fed: speculation pays far ahead, so the
    policy never decides a plain step, and inverts its decision now and then to time one. Where the
    drafter proposes nothing on 30% of steps (an n-gram lookup without a match) those steps are plain
    steps timed anyway, and no probe gives up a speculative step."""
    policy, rng, seq = AdaptiveK(MAX_K), random.Random(2), FakeSeq("a")
    chosen_plain = 0
    for step in range(2000):
        k = policy.choose([seq], [MAX_K])[0]
        chosen_plain += step >= 100 and k == 0
        drafted = k if rng.random() < proposing else 0
        accepted = 0
        while accepted < drafted and rng.random() < 0.9:
            accepted += 1
        policy.observe([seq], [drafted], [accepted], StepCost(1 + drafted, drafted, 0.010 + 0.0001 * drafted, 0.0))
    if proposing == 1.0:
        assert chosen_plain >= 5  # the probes, backing off to one every 512 steps
    else:
        assert chosen_plain == 0


def test_policy_counts_its_choices():
    """``k_choices`` (per request and per engine) and the steps with speculation off are exactly what
    ``choose`` returned, rows that could not draft (limit 0) left out."""
    policy, batch, rng = AdaptiveK(MAX_K), BatchMetrics(), random.Random(3)
    policy.bind_metrics(batch)
    seqs = [FakeSeq("a"), FakeSeq("b"), FakeSeq("c")]
    expected, per_row, off = Counter(), [Counter() for _ in seqs], 0
    for step in range(300):
        limits = [MAX_K, 3, 0 if step % 2 else MAX_K]
        ks = policy.choose(seqs, limits)
        for b, (k, limit) in enumerate(zip(ks, limits)):
            if limit:
                expected[k] += 1
                per_row[b][k] += 1
        off += not any(ks)
        accepted = [sum(1 for _ in range(k) if rng.random() < 0.15) for k in ks]  # low α: mostly off
        policy.observe(seqs, ks, accepted, StepCost(3 + sum(ks), max(ks), 0.010, 0.003 * max(ks)))
    assert batch.k_choices == dict(expected)
    assert [s.metrics.k_choices for s in seqs] == [dict(c) for c in per_row]
    assert batch.num_speculation_off_steps == off > 100
    assert len(batch.k_choices) > 1  # drafting steps (cold start, probes) and plain ones
    merged = RequestMetrics()
    for s in seqs:
        merged.merge(s.metrics)
    assert merged.k_choices == batch.k_choices


def test_fixed_k_respects_limits():
    assert FixedK(4).choose([FakeSeq("a"), FakeSeq("b")], [4, 2]) == [4, 2]


@pytest.mark.parametrize("config", [
    {"num_speculative_tokens": "four"},
    {"num_speculative_tokens": "auto", "max_num_speculative_tokens": 0},
    {"num_speculative_tokens": "auto", "max_num_speculative_tokens": 65},
    {"num_speculative_tokens": 4, "draft_confidence_threshold": 1.5},
    {"num_speculative_tokens": 4, "draft_confidence_threshold": True},
    {"num_speculative_tokens": 4, "max_step_time_ratio": 1.1},
    {"num_speculative_tokens": "auto", "max_step_time_ratio": 0.9},
    {"num_speculative_tokens": "auto", "max_step_time_ratio": "1.1"},
    {"num_speculative_tokens": "auto", "max_step_time_ratio": True},
    {"num_speculative_tokens": "auto", "max_step_time_ratio": float("nan")},
    {"num_speculative_tokens": "auto", "max_step_time_ratio": float("inf")},
])
def test_bad_auto_config(model_dirs, config):
    with pytest.raises(SpecDecError, match="num_speculative_tokens|draft_confidence_threshold|max_step_time_ratio"):
        LLM(model_dirs["llama"]["target"], dtype="float64",
            speculative_config={"method": "draft_model", "model": str(model_dirs["llama"]["random"]), **config})


def test_confidence_threshold_only_where_supported(model_dirs):
    with pytest.raises(SpecDecError, match="'ngram' takes no draft_confidence_threshold"):
        LLM(model_dirs["llama"]["target"], dtype="float64",
            speculative_config={"method": "ngram", "draft_confidence_threshold": 0.5})


PROMPTS = [[3, 5, 7, 3, 5, 7, 11, 3, 5], [42, 1, 17, 29, 8, 64, 2], [7], [90, 91, 90, 91, 90], [60, 5, 60, 6]]
MAX_TOKENS = [40, 24, 31, 17, 28]


def median_confidence(path) -> float:
    """The median top probability of a model's next-token distributions over :data:`PROMPTS`."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    with torch.no_grad():
        tops = [model(torch.tensor([p])).logits[0].softmax(-1).amax(-1) for p in PROMPTS]
    return torch.cat(tops).median().item()


@pytest.mark.parametrize("arch,backend", [("llama", "fast"), ("gpt2", "hf")])
@pytest.mark.parametrize("spec", [
    {"method": "draft_model", "draft": "truncated", "num_speculative_tokens": "auto"},
    {"method": "draft_model", "draft": "same", "num_speculative_tokens": "auto", "max_num_speculative_tokens": 3},
    {"method": "draft_model", "draft": "truncated", "num_speculative_tokens": 4, "draft_confidence_threshold": None},
    {"method": "ngram", "num_speculative_tokens": "auto"},
    {"method": "draft_model", "draft": "truncated", "num_speculative_tokens": "auto", "max_step_time_ratio": 1.5},
], ids=["auto-truncated", "auto-same-max3", "threshold", "auto-ngram", "auto-bounded"])
def test_greedy_equality_with_auto_k(model_dirs, arch, backend, spec):
    """Batched greedy output with auto k (real timings, whatever they choose) equals plain greedy output."""
    dirs = model_dirs[arch]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    requests = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = LLM(dirs["target"], dtype="float64", backend=backend, max_num_seqs=4).generate(requests, params)
    config = {k: v for k, v in spec.items() if k != "draft"}
    if "draft" in spec:
        config["model"] = str(dirs[spec["draft"]])
    if "draft_confidence_threshold" in spec:  # random models are flat: stop at the draft's median confidence
        config["draft_confidence_threshold"] = median_confidence(dirs[spec["draft"]])
    llm = LLM(dirs["target"], dtype="float64", backend=backend, max_num_seqs=4, speculative_config=config)
    outputs = llm.generate(requests, params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    assert llm.batch_metrics.num_draft_tokens > 0
    if "draft_confidence_threshold" in spec:  # some rows stopped early
        assert llm.batch_metrics.num_draft_tokens < 4 * llm.batch_metrics.num_rows


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from helpers import build_model
    from test_sampling_exactness import VOCAB

    root = tmp_path_factory.mktemp("adaptive_exact")
    target = build_model("llama", seed=11, vocab=VOCAB, layers=2, scale=3.0)
    build_model("llama", seed=12, vocab=VOCAB, layers=1, scale=3.0).save_pretrained(root / "draft")
    target.save_pretrained(root / "target")
    return target, root


CASES = [
    # auto k (at most 2) with a fixed synthetic cost, so that rows choose 0, 1 or 2 drafts from their
    # own measured acceptance, step by step.
    ({"num_speculative_tokens": "auto", "max_num_speculative_tokens": 2}, {0, 1, 2}),
    # k = 2 with the confidence stop: the draft's top probability is 0.33 after the prompt and 0.18
    # to 0.39 after its first token, so whether a row drafts a second token depends on its first.
    ({"num_speculative_tokens": 2, "draft_confidence_threshold": 0.3}, {1, 2}),
]


@pytest.mark.parametrize("config,lengths", CASES, ids=["auto", "threshold"])
def test_sampling_exactness(pair, monkeypatch, config, lengths):
    target, root = pair
    monkeypatch.setattr(AdaptiveK, "cost_model", lambda self, rows: CostModel(1.0, 0.02, 0.25))
    llm = LLM(root / "target", speculative_config={"method": "draft_model", "model": str(root / "draft"), **config},
              dtype="float64", max_num_seqs=BATCH)
    drafted: list[int] = []
    step = llm.engine.step

    def counting_step(seqs, **kwargs):
        outputs = step(seqs, **kwargs)
        drafted.extend(o.num_drafted for o in outputs)
        return outputs

    monkeypatch.setattr(llm.engine, "step", counting_step)
    assert_matches_target(target, llm, [3, 1, 4], "auto-k")
    assert lengths <= set(drafted), f"the test needs rows drafting {sorted(lengths)} tokens, saw {set(drafted)}"


class RaggedK(FixedK):
    """Every step, row ``b`` drafts ``(step + b) % (max_k + 1)`` tokens (within its limit): ragged widths."""

    def __init__(self, max_k: int) -> None:
        super().__init__(max_k)
        self.steps = 0

    def choose(self, seqs, limits, backlog=None, prompt_tokens=0, prompt_backlog=0):
        self.steps += 1
        return [min((self.steps + b) % (self.k + 1), limit) for b, limit in enumerate(limits)]


def test_ragged_ks_from_one_greedy_chain_stay_exact(model_dirs, tmp_path):
    """Rows drafting different k in one step share one greedy chain to the widest row's width and keep
    their own first k tokens; rows whose draft context is nearly full (a draft with a shorter context
    than the target's) take the per-position path. Batched output equals plain greedy output."""
    dirs = model_dirs["llama"]
    short = AutoModelForCausalLM.from_pretrained(dirs["truncated"], dtype=torch.float64)
    short.config.max_position_embeddings = 36  # the longest requests outgrow the draft's context
    short.save_pretrained(tmp_path / "short")
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    requests = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = LLM(dirs["target"], dtype="float64", max_num_seqs=4).generate(requests, params)
    for draft in (dirs["truncated"], tmp_path / "short"):
        llm = LLM(dirs["target"], dtype="float64", max_num_seqs=4,
                  speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4})
        llm.engine.policy = RaggedK(4)
        chains = spy(llm.engine.drafter.model, "greedy_chain")
        outputs = llm.generate(requests, params)
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
        assert llm.batch_metrics.num_accepted_tokens > 0 and len(chains) > 10  # ragged steps took the chain


def test_steps_that_paid_a_one_time_setup_teach_acceptance_but_not_cost():
    """A step during which a CUDA graph was captured or a graph compiled (seconds on a GPU) is no measure of
    its shape: the policy learns the rows' acceptance from it and nothing of the step's time."""
    policy, rng = AdaptiveK(MAX_K), random.Random(0)
    seqs = [FakeSeq("a")]
    for _ in range(50):
        ks = policy.choose(seqs, [MAX_K])
        accepted = bernoulli_accepted(ks, 0.8, rng)
        policy.observe(seqs, ks, accepted, StepCost(1 + ks[0], ks[0], 2.0, 1.0, setup=True))
    assert policy.measured == 0 and policy.draft_cost() is None
    assert policy.pool.rates([0.0] * MAX_K)[0] > 0.6  # acceptance at the first position, learned from α = 0.8


def test_the_engine_flags_steps_that_paid_a_one_time_setup(model_dirs, monkeypatch):
    """The engine compares :func:`one_time_setups` before and after each step; with a set-up in every step the
    policy measures none, and without one it measures them."""
    import specdec.engine

    dirs = model_dirs["llama"]
    config = {"method": "draft_model", "model": str(dirs["truncated"]), "num_speculative_tokens": "auto"}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    counter = iter(range(10**6))
    for setups, measured in ((lambda: next(counter), False), (lambda: 0, True)):
        monkeypatch.setattr(specdec.engine, "one_time_setups", setups)
        llm = LLM(dirs["target"], dtype="float64", speculative_config=config)
        llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], params)
        assert (llm.engine.policy.measured > 0) == measured


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_backlog_is_what_the_next_proposal_catches_up_on(model_dirs, tmp_path, method):
    """A drafter's ``backlog`` (what bounds a probe's rows) counts the positions its next ``propose`` feeds its
    own model: every prompt token first (the draft model is fed nothing until its row drafts; an EAGLE layer
    gets every prompt feature but the pending token's); one more per step the row sits out; and a proposal
    catches all of it up. The draft model catches up in ``catch_up``, which the engine calls first and times
    apart (the policy sees it as ``catch_up_seconds``, within the drafting time), down to the two tokens the
    proposal's own forward feeds (a backlog of more than ``FOLD_WIDTH`` positions here: a smaller one is fed by the
    proposal, ``test_draft_catch_up.py``); an EAGLE layer catches up in its proposal's one forward."""
    from test_heads import make_heads

    dirs = model_dirs["llama"]
    if method == "draft_model":
        config = {"method": method, "model": str(dirs["truncated"]), "num_speculative_tokens": 2}
    else:
        make_heads(AutoModelForCausalLM.from_pretrained(dirs["target"], dtype=torch.float64), "eagle", tmp_path, 3)
        config = {"method": method, "model": str(tmp_path), "num_speculative_tokens": 2}
    llm = LLM(dirs["target"], dtype="float64", speculative_config=config)
    prompt = [(5 * i) % 50 + 3 for i in range(21)]
    llm.submit({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine, drafter = llm.engine, llm.engine.drafter
    engine.policy.choose = lambda seqs, limits, *_: [0] * len(seqs)  # sit out
    outputs = llm.step()
    seq = llm.scheduler.running[0]
    first = len(prompt) if method == "draft_model" else len(prompt) - 1
    assert len(outputs[0].token_ids) == 1 and drafter.backlog([seq]) == [first + 1]
    for _ in range(3):
        llm.step()
    assert drafter.backlog([seq]) == [first + 4]
    engine.policy.choose = lambda seqs, limits, *_: [min(2, limit) for limit in limits]
    left, costs = [], []
    catch_up, observe = drafter.catch_up, engine.policy.observe
    drafter.catch_up = lambda seqs, ks: (catch_up(seqs, ks), left.append(drafter.backlog(seqs)))
    engine.policy.observe = lambda seqs, drafted, accepted, step: (costs.append(step),
                                                                   observe(seqs, drafted, accepted, step))
    llm.step()
    assert drafter.backlog([seq])[0] <= 2  # caught up: at most the pending token and an accepted draft
    assert left[0] == ([2] if method == "draft_model" else [first + 4])
    assert len(costs) == 1 and 0 < costs[0].catch_up_seconds < costs[0].draft_seconds
