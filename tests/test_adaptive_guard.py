"""The guard of ``num_speculative_tokens="auto"`` (its cost model calibrated by measured step times)
on synthetic figures.

:class:`AdaptiveK` runs against Bernoulli(α) acceptance and a synthetic clock, with its cost model
pinned to one that says drafting is cheap (so uncalibrated it always wants to speculate): the
calibration alone must switch speculation off where drafting steps take far longer than predicted,
keep probing while it does, leave it on where drafting pays (probing less where it pays by far),
judge each row count apart, and leave a request's own acceptance in charge (a slow request before
a fast one does not switch the fast one off).
"""

import random
from dataclasses import dataclass, field, replace

import pytest

from specdec import adaptive, step_cost
from specdec.adaptive import FAR_ABOVE, FAR_BELOW_PROBES, FAR_PROBES, AdaptiveK, choose_ks
from specdec.catch_up import CATCH_UP_BUDGET, least_behind
from specdec.metrics import BatchMetrics, RequestMetrics
from specdec.step_cost import CostModel, StepCost

MAX_K = 8
PROBE_EVERY = 16
PLAIN_SECONDS = 0.010
CHEAP = CostModel(intercept=PLAIN_SECONDS, slope=0.0, draft=0.0001)  # flat target, nearly free drafts


@dataclass
class FakeSeq:
    request_id: str
    metrics: RequestMetrics = field(default_factory=RequestMetrics)


def slow_drafting(rows: int, width: int) -> tuple[float, float]:
    """A drafting step secretly costs three plain steps per position fed: far slower per emitted
    token than plain decoding, whatever the pinned model predicts."""
    return (3 * PLAIN_SECONDS * (width + 1), 0.0001 * width) if width else (PLAIN_SECONDS, 0.0)


def fast_drafting(rows: int, width: int) -> tuple[float, float]:
    """A drafting step of width 8 costs 2.6 plain steps, but emits about 4.3 tokens per row at α = 0.8:
    each step is slower, each emitted token faster."""
    return (PLAIN_SECONDS + 0.002 * width, 0.0) if width else (PLAIN_SECONDS, 0.0)


def one_row_fast_sixteen_slow(rows: int, width: int) -> tuple[float, float]:
    return slow_drafting(rows, width) if rows == 16 else fast_drafting(rows, width)


@pytest.fixture
def pinned(monkeypatch):
    """The model predicts what :data:`CHEAP` says whatever is measured: only the calibration can switch off."""
    monkeypatch.setattr(AdaptiveK, "cost_model", lambda self, rows: CHEAP)


class World:
    """One policy, stepped over batches of synthetic sequences."""

    def __init__(self, clock, alpha: float = 0.8, seed: int = 0, max_step_ratio: float | None = None,
                 catch_up: float = 0.0, apart: bool = True, per_position: float = 0.0, padded: bool = False) -> None:
        self.policy = AdaptiveK(MAX_K, probe_every=PROBE_EVERY, max_step_ratio=max_step_ratio, padded=padded)
        self.clock, self.alpha = clock, alpha
        # A drafting step first catches up on every step since the last one: ``catch_up`` seconds each, in its
        # drafting time, reported as ``catch_up_seconds`` where ``apart`` (as the engine does), and ``per_position``
        # seconds per position of backlog of the rows joining the drafting.
        self.catch_up, self.apart, self.behind, self.per_position = catch_up, apart, 0, per_position
        self.rng = random.Random(seed)
        self.metrics = BatchMetrics()
        self.policy.bind_metrics(self.metrics)

    def run(self, seqs: list[FakeSeq], steps: int, backlog: list[int] | None = None,
            prompts: list[int] | None = None) -> list[tuple[bool, list[int]]]:
        """``(probe step?, ks chosen)`` per step (``backlog``: the rows' drafters' catch-up, every step;
        ``prompts[i]``: the prompt tokens step ``i`` feeds besides, none where not given)."""
        chosen = []
        for i in range(steps):
            before = self.policy.next_probe
            ks = self.policy.choose(seqs, [MAX_K] * len(seqs), None if backlog is None else lambda rows: backlog,
                                    prompts[i] if prompts else 0)
            accepted = []
            for k in ks:
                a = 0
                while a < k and self.rng.random() < self.alpha:
                    a += 1
                accepted.append(a)
            width = max(ks)
            target, draft = self.clock(len(seqs), width)
            catch_up = self.catch_up * self.behind + self.per_position * self.policy.joining if width else 0.0
            self.behind = 0 if width else self.behind + 1
            self.policy.observe(seqs, ks, accepted, StepCost(len(seqs) + sum(ks), width, target, draft + catch_up,
                                                             catch_up_seconds=catch_up if self.apart else 0.0))
            chosen.append((self.policy.next_probe != before, ks))  # a probe schedules the next one
        return chosen


def batch(rows: int, name: str = "") -> list[FakeSeq]:
    return [FakeSeq(f"{name}{b}") for b in range(rows)]


def test_guard_switches_off_measured_slow_speculation_and_keeps_probing(pinned):
    """16 rows, α = 0.9 and a model that says drafting is nearly free (it predicts a speedup of
    several times), but drafting steps measure about 3x slower per emitted token: after a warm-up,
    every step is plain but the probes, which draft every ``probe_every`` steps."""
    world = World(slow_drafting, alpha=0.9)
    chosen = world.run(batch(16), 300)
    late = chosen[100:]
    assert all(ks == [0] * 16 for probe, ks in late if not probe)
    probes = [ks for probe, ks in late if probe]
    assert len(probes) == len(late) // PROBE_EVERY and all(any(ks) for ks in probes)
    assert world.policy.drafting_scale(16) > 3 and world.policy.last_speedup == 1.0  # plain predicted best
    assert choose_ks([[0.9] * MAX_K] * 16, [MAX_K] * 16, CHEAP)[1] > 2  # uncalibrated, it would speculate
    # Guard-off steps are counted like any other step with speculation off, once each.
    assert world.metrics.num_speculation_off_steps == sum(not any(ks) for _, ks in chosen) > 200
    assert world.metrics.k_choices[0] == 16 * world.metrics.num_speculation_off_steps


def test_a_probe_while_off_drafts_the_rows_whose_drafters_are_least_behind(pinned):
    """Off, a probe drafts only the rows with the least to catch up, within ``CATCH_UP_BUDGET`` positions per row
    of the step (row ``b`` here has ``10 b + 1``: rows 0-3 add up to 64 of 16 x 4); with no backlog given,
    every row. Speculation stays off either way."""
    backlog = [10 * b + 1 for b in range(16)][::-1]  # the least behind last
    for given, drafting in ((backlog, set(range(12, 16))), (None, set(range(16)))):
        late = World(slow_drafting, alpha=0.9).run(batch(16), 300, given)[100:]
        probes = [ks for probe, ks in late if probe]
        assert probes and all({b for b, k in enumerate(ks) if k} == drafting for ks in probes)
        assert all(ks == [0] * 16 for probe, ks in late if not probe)


def test_a_probe_while_off_waits_for_a_step_that_feeds_no_prompt(pinned, monkeypatch):
    """Off, a probe that is due on a step feeding prompt tokens waits for the next step that feeds none (every
    fifth here): every probe drafts on such a step, each at most four steps late. Probing when due, most would
    come on a step feeding prompts."""
    feeds = [0 if i % 5 == 4 else 32 for i in range(400)]
    late = list(zip(World(slow_drafting, alpha=0.9).run(batch(16), 400, prompts=feeds), feeds))[100:]
    probes = [i for i, ((_, ks), _) in enumerate(late) if any(ks)]
    assert len(probes) >= 300 // (PROBE_EVERY + 4) and all(late[i][1] == 0 for i in probes)
    assert all(b - a <= PROBE_EVERY + 4 for a, b in zip(probes, probes[1:]))
    assert all(ks == [0] * 16 for (_, ks), fed in late if fed)
    monkeypatch.setattr(AdaptiveK, "_may_probe", lambda self, ks, prompt_tokens: True)
    late = list(zip(World(slow_drafting, alpha=0.9).run(batch(16), 400, prompts=feeds), feeds))[100:]
    assert sum(1 for (_, ks), fed in late if any(ks) and fed) > sum(1 for (_, ks), fed in late if any(ks) and not fed)


def test_least_behind_keeps_the_rows_drafting_the_first_row_and_then_what_fits():
    budget = CATCH_UP_BUDGET * 4
    assert least_behind([1, 1, 1, 1], [50, 3, budget - 5, 2]) == [0, 1, 1, 1]  # 2 + 3 + 11 = 16
    assert least_behind([1, 1, 1, 1], [50, 3, budget - 4, 2]) == [0, 1, 0, 1]  # 17 would not fit
    assert least_behind([1, 1], [500, 900]) == [1, 0]  # the least behind always drafts
    # Rows that drafted on their previous step are kept whatever their backlog (what that step committed), and
    # the budget is the others': 30 joins (the first), 30 + 40 would not fit.
    assert least_behind([1, 1, 1, 1], [9, 40, 9, 30], [True, False, True, False]) == [1, 0, 1, 1]
    assert least_behind([1, 0, 1], [5, 0, 5]) == [1, 0, 1]  # a row that may not draft is no candidate; ties in order
    assert least_behind([0, 0], [1, 1]) == [0, 0]


def test_under_a_bound_the_catch_up_budget_is_in_seconds(pinned):
    """Under a bound of 1.25 plain steps, 16 rows off (drafting measured slow) whose drafters are 5 positions
    behind, each position 0.02 plain steps to catch up on: the seconds per position are measured (to 1%) on the
    steps that rows join, and once speculation is off, a probe of one row fits the bound (1.1 plain steps predicted)
    but nothing is left for a second row (drafting measured slow). Without a bound, every probe joins the rows
    within ``CATCH_UP_BUDGET`` positions a row: 12 rows, 1.2 plain steps of catch-up."""
    cost = 0.02 * PLAIN_SECONDS
    for bound in (1.25, None):
        world = World(slow_drafting, alpha=0.9, max_step_ratio=bound, per_position=cost)
        late = world.run(batch(16), 300, [5] * 16)[100:]
        assert all(ks == [0] * 16 for probe, ks in late if not probe)
        probes = [sum(k > 0 for k in ks) for probe, ks in late if probe]
        assert len(probes) > 10 and set(probes) == ({1} if bound else {12})
        assert world.policy.catch_up.per_position() == pytest.approx(cost, rel=0.01)


def test_under_a_bound_a_row_far_behind_is_still_probed(pinned, monkeypatch):
    """One row under a bound of 1.25, off (drafting measured slow), whose drafter is 100 positions behind at 0.02
    plain steps a position (two plain steps of catch-up, where one draft leaves a quarter of one): the catch-up is
    a cost of switching, so the probes still come, one position each, every ``probe_every`` steps. Priced in the
    probe's check, no probe would come once the rate is measured: the longer off, the further behind."""
    cost = 0.02 * PLAIN_SECONDS
    world = World(slow_drafting, alpha=0.9, max_step_ratio=1.25, per_position=cost)
    late = world.run(batch(1), 300, [100])[100:]
    probes = [ks for probe, ks in late if any(ks)]
    assert len(probes) >= len(late) // PROBE_EVERY - 1 and all(ks == [1] for ks in probes)
    assert world.policy.catch_up.per_position() == pytest.approx(cost, rel=0.01)

    def priced(self, rows, model):
        rate = self.catch_up.per_position() or 0.0
        return model.left_in_bound(self.max_step_ratio, rows, rows + 1, 1) >= rate * 100

    monkeypatch.setattr(AdaptiveK, "_cheapest_fits", priced)
    late = World(slow_drafting, alpha=0.9, max_step_ratio=1.25, per_position=cost).run(batch(1), 300, [100])[100:]
    assert not any(any(ks) for _, ks in late)


def test_a_hiccup_of_the_machine_does_not_switch_speculation_off(monkeypatch):
    """One row under a bound of 1.25 plain steps, as a draft model at the ``1b`` shape: a draft costs 0.18 plain
    steps, so one draft (1.18 plain steps) is within the bound by 6% and two are over it. One drafting step takes
    twice its time (the host's hiccup): counted as at most ``HICCUP`` times what was expected, speculation stays on
    throughout; counted in full (up to 3x), it moved the calibration by a tenth and turned speculation off until
    five probes, 16 steps apart, had measured it back."""
    edge = CostModel(intercept=PLAIN_SECONDS, slope=0.0, draft=0.18 * PLAIN_SECONDS)
    monkeypatch.setattr(AdaptiveK, "cost_model", lambda self, rows: edge)
    for hiccup, stays_on in ((step_cost.HICCUP, True), (3.0, False)):
        monkeypatch.setattr(step_cost, "HICCUP", hiccup)
        steps = iter(range(1, 401))

        def clock(rows: int, width: int, steps=steps) -> tuple[float, float]:
            slow = 2.0 if next(steps) == 200 else 1.0
            return (PLAIN_SECONDS * slow, 0.18 * PLAIN_SECONDS * width * slow) if width else (PLAIN_SECONDS, 0.0)

        after = [ks for _, ks in World(clock, alpha=0.9, max_step_ratio=1.25).run(batch(1), 400)[200:300]]
        assert all(ks in ([0], [1]) for ks in after)
        off = sum(ks == [0] for ks in after)
        assert off <= 100 // PROBE_EVERY if stays_on else off > 50


def test_a_slow_phase_while_speculating_does_not_switch_speculation_off(monkeypatch):
    """One row under a bound of 1.25 plain steps, as a draft model at the ``1b`` shape (one draft 1.18 plain steps,
    6% inside the bound). For eight steps while speculating, every step takes 1.45x its time (a slow phase of the
    host, which the target's forward and the draft share). Taken at the host's pace (:class:`step_cost.Pace`), the
    drafting steps are compared with the steps just before them, the phase moves the calibration little, and
    speculation stays on but for the probes. Calibrated on its own steps alone (before 2026-12-01), the drafting
    kind took the phase in as its own cost and kept it until probes had measured it back: off for most of the 100
    steps after the phase."""
    edge = CostModel(intercept=PLAIN_SECONDS, slope=0.0, draft=0.18 * PLAIN_SECONDS)
    monkeypatch.setattr(AdaptiveK, "cost_model", lambda self, rows: edge)

    def apart(self, kind, measured, predicted):
        kind.add(measured, predicted)

    for calibrate, stays_on in ((step_cost.Pace.calibrate, True), (apart, False)):
        monkeypatch.setattr(step_cost.Pace, "calibrate", calibrate)
        steps = iter(range(1, 401))

        def clock(rows: int, width: int, steps=steps) -> tuple[float, float]:
            slow = 1.45 if 200 <= next(steps) < 208 else 1.0
            return PLAIN_SECONDS * slow, 0.18 * PLAIN_SECONDS * width * slow

        after = [ks for _, ks in World(clock, alpha=0.9, max_step_ratio=1.25).run(batch(1), 400)[200:300]]
        assert all(ks in ([0], [1]) for ks in after)
        off = sum(ks == [0] for ks in after)
        assert off <= 100 // PROBE_EVERY if stays_on else off > 50


def test_a_slow_phase_of_the_host_does_not_price_a_drafting_shape_over_the_bound(monkeypatch):
    """One row under a bound of 1.25, as a draft model at the ``1b`` shape: plain steps of 0.1 s, prompt chunks fed in
    the step's own forward (which set the line's slope), a two-token step of 0.1015 s and a draft of 0.016 s: one
    draft costs 1.175 plain steps. Four two-token steps take 1.45x their time (a slow phase of the host, as in a traced
    run), then speculation is off for 60 steps, where a drafting shape is timed only at probes. Counted as at most
    ``HICCUP`` times the shape's mean, the slow phase leaves the shape within 10% of the line and one draft within the
    bound (uncalibrated: a probe is taken). Counted in full, the shape's mean stays 13% over the line until probes
    re-time it, and one draft is priced over the bound: the probes that would re-time it are refused."""
    for hiccup, fits in ((step_cost.HICCUP, True), (3.0, False)):
        monkeypatch.setattr(adaptive, "HICCUP", hiccup)
        policy, seqs = AdaptiveK(MAX_K, max_step_ratio=1.25), batch(1)

        def steps(count: int, drafting: bool, slow: float = 1.0, policy=policy, seqs=seqs) -> None:
            for i in range(count):
                if i % 4 == 3 and slow == 1.0:  # 64 prompt tokens at 3.5 ms each, in the step's forward
                    policy.observe(seqs, [0], [0], StepCost(1, 0, 0.1 + 64 * 0.0035, 0.0, prompt_tokens=64,
                                                           prompt_fused=True))
                elif drafting and (i % 8 or slow > 1.0):
                    policy.observe(seqs, [1], [1], StepCost(2, 1, 0.1015 * slow, 0.016))
                else:
                    policy.observe(seqs, [0], [0], StepCost(1, 0, 0.1, 0.0))

        steps(120, drafting=True)
        assert policy.cost_model(1).left_in_bound(1.25, 1, 2, 1) > 0
        steps(4, drafting=True, slow=1.45)
        steps(60, drafting=False)
        assert (policy.cost_model(1).left_in_bound(1.25, 1, 2, 1) > 0) == fits


def test_catch_up_budget_in_seconds_is_what_the_bound_leaves():
    """The budget in seconds, by hand: plain 16 rows cost 0.0116 s, a step drafting one position 0.0117 s
    (0.0116 + 0.0001 per token and 0.0005 a position) with no row drafting yet, so a bound of 1.25 leaves
    0.0024 s; a row 5 positions behind costs 5 x 0.0004 s of catch-up and 0.0001 s of verification: one row fits
    (the second would need 0.0042 s). Budgeted in positions (the rate not measured yet), 12 rows join."""
    policy, seqs = AdaptiveK(MAX_K, max_step_ratio=1.25), batch(16)
    model = CostModel(intercept=0.01, slope=0.0001, draft=0.0005)
    assert policy._catching_up([1] * 16, seqs, lambda rows: [5] * 16, model).count(1) == 12
    policy.catch_up.add(10, 0.004)
    policy.catch_up.add(10, 0.004)
    assert policy._catching_up([1] * 16, seqs, lambda rows: [5] * 16, model).count(1) == 1
    # The least behind first: 0.0005 s for a row 1 behind, then 0.0013 s for a row 3 behind (a third would not fit).
    assert policy._catching_up([1] * 16, seqs, lambda rows: [3] * 15 + [1], model) == [1] + [0] * 14 + [1]
    assert policy.joining == 4
    # A probe's cheapest form, one row one position (0.0122 s), fits the bound; its catch-up is not priced.
    assert policy._cheapest_fits(16, model)
    assert not policy._cheapest_fits(16, replace(model, draft_fixed=0.0024))  # 0.0146 s: over 0.0145 s


def test_under_a_bound_no_probe_where_one_draft_is_over_it(monkeypatch):
    """A target bound by arithmetic (1 ms a token fed) on a padded grid: one draft doubles the grid of 16 rows, so
    every drafting step is over a bound of 1.25, the cheapest probe's included, and no step drafts at all. Unpadded,
    one draft adds one token: the probes (one row, least behind) come every few periods. Without a bound, padded,
    the probes come too."""
    steep = CostModel(intercept=0.001, slope=0.001, draft=0.0001)
    monkeypatch.setattr(AdaptiveK, "cost_model", lambda self, rows: steep)

    def clock(rows: int, width: int) -> tuple[float, float]:
        return steep.target_seconds(rows * (width + 1)), 0.0001 * width

    for padded, bound in ((True, 1.25), (False, 1.25), (True, None)):
        chosen = World(clock, alpha=0.8, max_step_ratio=bound, padded=padded).run(batch(16), 300, [3] * 16)
        drafting = [ks for _, ks in chosen if any(ks)]
        if padded and bound:
            assert not drafting
        else:
            assert len(drafting) >= 300 // (FAR_BELOW_PROBES * PROBE_EVERY)


def test_guard_leaves_measured_fast_speculation_on(pinned):
    """Drafting steps cost 2.6 plain steps but emit about 4.3x the tokens: the guard never
    intervenes, and every step but the plain probes drafts; measured that far ahead (more than
    ``FAR_ABOVE`` times plain's throughput), the plain probes back off: the period doubles per probe
    up to ``FAR_PROBES`` periods."""
    world = World(fast_drafting, alpha=0.8)
    chosen = world.run(batch(16), 1200)
    assert world.policy.drafting_scale(16) is not None and world.policy.last_speedup > FAR_ABOVE
    late = chosen[100:]
    assert all(any(ks) for probe, ks in late if not probe) and all(ks == [0] * 16 for probe, ks in late if probe)
    probes = [step for step, (probe, _) in enumerate(chosen) if probe]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:2] == [PROBE_EVERY] * 2 and gaps[-1] == PROBE_EVERY * FAR_PROBES
    assert all(b in (a, 2 * a) for a, b in zip(gaps, gaps[1:]))
    assert world.metrics.num_speculation_off_steps == sum(not any(ks) for _, ks in chosen) < 12


def test_guard_is_per_row_count(pinned):
    """Speculation measured slow at 16 rows stays off at 16 rows, but a single row (drafting fast
    there, never measured yet) drafts from its first step; back at 16 rows, the guard still holds."""
    world = World(one_row_fast_sixteen_slow, alpha=0.9)
    sixteen = world.run(batch(16, "a"), 200)
    assert all(ks == [0] * 16 for probe, ks in sixteen[100:] if not probe)
    one = world.run(batch(1, "b"), 100)
    assert all(ks[0] > 0 for probe, ks in one if not probe)
    assert world.policy.drafting_scale(16) > 2 * world.policy.drafting_scale(1)
    again = world.run(batch(16, "c"), 50)
    assert all(ks == [0] * 16 for probe, ks in again if not probe)


def test_guard_lets_speculation_back_when_it_pays_again(pinned):
    """The world changes (drafting stops being slow): the probes measure it, and speculation returns."""
    clock = {"now": slow_drafting}
    world = World(lambda rows, width: clock["now"](rows, width), alpha=0.9)
    seqs = batch(16)
    assert all(ks == [0] * 16 for probe, ks in world.run(seqs, 200)[100:] if not probe)
    clock["now"] = fast_drafting
    back = world.run(seqs, 600)[-100:]
    assert all(any(ks) for probe, ks in back if not probe)


@pytest.mark.parametrize("max_step_ratio", [1.5, None])
def test_under_a_bound_rows_far_behind_join_the_drafting_a_few_a_step(pinned, max_step_ratio):
    """Under a bound, every step's catch-up is capped as a probe's is (:func:`least_behind`): of 16 rows whose
    drafters are 40 positions behind (a prompt each), the rows drafting stay and the others join, one a step at
    least, within ``CATCH_UP_BUDGET`` positions a row of the step, until every row drafts. Without a bound, every row
    drafts on the first decision and catches up at once."""
    world, backlog, last = World(fast_drafting, alpha=0.8, max_step_ratio=max_step_ratio), [40] * 16, [0] * 16
    seqs, chosen = batch(16), []
    for _ in range(40):
        (_, ks), = world.run(seqs, 1, backlog)
        joining = [backlog[b] for b, k in enumerate(ks) if k and not last[b]]
        chosen.append((ks, joining))
        backlog[:] = [1 if k else behind + 1 for k, behind in zip(ks, backlog)]  # drafting catches up
        last = ks
    drafting = [(ks, joining) for ks, joining in chosen if any(ks)]
    if max_step_ratio is None:
        assert drafting[0] == ([MAX_K] * 16, [40] * 16)
        return
    assert all(len(joining) == 1 or sum(joining) <= CATCH_UP_BUDGET * 16 for _, joining in drafting)
    assert all(joining for _, joining in drafting[:8])  # a row joins on every drafting step while any is behind
    assert all(all(ks) for ks, _ in drafting[-5:])  # every row drafts once none is far behind


def test_a_probe_after_a_pause_is_priced_without_its_catch_up(pinned):
    """One row at α = 0.9 under a bound of 1.25 plain steps, as a draft model at the ``1b`` shape: a draft costs
    0.1 plain steps (1.1 with the target's step: within the bound, and paying), but first drafting is slow (3
    plain steps a position) and switches speculation off. Once drafting is cheap again, each probe pays its
    drafter's catch-up on the 15 steps since the last draft (0.04 plain steps each: 0.6 a probe). Priced in,
    the catch-up keeps one draft over the bound and speculation off for good; timed apart (as the engine
    reports it), the probes measure the draft itself and speculation returns."""
    clock = {"now": slow_drafting}
    for apart in (False, True):
        world = World(lambda rows, width: clock["now"](rows, width), alpha=0.9, max_step_ratio=1.25,
                      catch_up=0.04 * PLAIN_SECONDS, apart=apart)
        clock["now"] = slow_drafting
        assert all(ks == [0] for probe, ks in world.run(batch(1), 200)[100:] if not probe)
        clock["now"] = lambda rows, width: (PLAIN_SECONDS, 0.1 * PLAIN_SECONDS * width)
        back = world.run(batch(1), 1000)[-200:]
        drafting = sum(any(ks) for _, ks in back)
        if apart:
            assert drafting > 180
        else:  # one draft (1.1 plain steps predicted) calibrated over the bound
            assert drafting < 20 and world.policy.drafting_scale(1) * 1.1 > 1.25


def test_a_slow_request_does_not_switch_the_next_one_off():
    """Batch 1, the model not pinned: a request whose drafts are rarely accepted (speculation off for
    it), then one that accepts nearly all: the second drafts on nearly every step after its first few
    (the calibration judges the model's costs; acceptance stays each request's own)."""
    world = World(lambda rows, width: (0.010 + 0.0002 * (rows + width), 0.001 * width), alpha=0.05)
    slow = world.run(batch(1, "slow"), 200)
    assert sum(any(ks) for _, ks in slow[100:]) < 15
    world.alpha = 0.95
    fast = world.run(batch(1, "fast"), 100)
    assert sum(any(ks) for _, ks in fast[10:]) > 80


def test_backed_off_probes_do_not_slow_the_switch_off(pinned):
    """Far ahead for long enough that the plain probes backed off to their longest period, the world
    changes (drafting turns slow): the drafting steps' own calibration switches speculation off, and the
    probes come every ``probe_every`` steps again."""
    clock = {"now": fast_drafting}
    world = World(lambda rows, width: clock["now"](rows, width), alpha=0.8)
    seqs = batch(16)
    world.run(seqs, 1200)
    assert world.policy.probe_period == PROBE_EVERY * FAR_PROBES
    clock["now"] = slow_drafting
    after = world.run(seqs, 200)
    assert all(ks == [0] * 16 for probe, ks in after[100:] if not probe)
    assert world.policy.probe_period == PROBE_EVERY
    assert sum(probe for probe, _ in after[100:]) in (100 // PROBE_EVERY, 100 // PROBE_EVERY + 1)  # by phase


def test_steps_no_row_may_draft_leave_the_probes_alone(pinned):
    """A step where no row may draft (each is at its last token, as every request's last step is)
    says nothing about whether speculation pays: backed-off probes stay backed off, and it is no
    speculation-off step. (Counted as not far ahead, it used to bring the probes back every
    ``probe_every`` steps after each request.)"""
    world = World(fast_drafting, alpha=0.8)
    seqs = batch(16)
    world.run(seqs, 1200)
    assert world.policy.probe_period == PROBE_EVERY * FAR_PROBES
    for _ in range(5):
        off = world.metrics.num_speculation_off_steps
        assert world.policy.choose(seqs, [0] * 16) == [0] * 16
        assert world.metrics.num_speculation_off_steps == off
        world.run(seqs, 30)
    assert world.policy.probe_period == PROBE_EVERY * FAR_PROBES


def test_probes_back_off_where_the_model_prices_them_far_below_plain():
    """16 rows at α = 0.3 and a target forward costing 1 ms a token fed (compute-bound verification, as
    at 16 rows on a 2-core CPU): speculation is off and a probe of 2 tokens a row costs about three
    plain steps for 1.4 tokens a row, so the probes back off, the period doubling per probe up to
    ``FAR_BELOW_PROBES`` periods. When the forward turns flat (a free verification), the next probe
    measures it, and speculation returns within a few probes."""
    clock = {"now": lambda rows, width: (0.001 * rows * (width + 1), 0.0)}
    world = World(lambda rows, width: clock["now"](rows, width), alpha=0.3)
    seqs = batch(16)
    chosen = world.run(seqs, 1000)
    assert all(ks == [0] * 16 for probe, ks in chosen[100:] if not probe)
    probes = [step for step, (probe, _) in enumerate(chosen) if probe]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[-1] == PROBE_EVERY * FAR_BELOW_PROBES and all(b in (a, 2 * a) for a, b in zip(gaps, gaps[1:]))
    assert len(probes) < 1000 // PROBE_EVERY // 3  # not one every PROBE_EVERY steps
    world.alpha = 0.9
    clock["now"] = lambda rows, width: (0.016 + 0.00001 * rows * width, 0.0)
    back = world.run(seqs, 4 * PROBE_EVERY * FAR_BELOW_PROBES)
    assert sum(any(ks) for _, ks in back[-100:]) > 90


def test_no_probe_where_a_probe_is_over_the_step_time_bound():
    """One row at α = 0.9, a flat 10 ms target and drafting 5 ms a position: one draft position pays (1.9
    tokens for 1.5 plain steps), so without a bound the policy drafts. Under a bound of 1.2 plain steps no
    draft is within it, the cheapest probe's included: speculation stays off and the probes that come due are
    skipped, their period doubling up to ``FAR_BELOW_PROBES`` periods. After the cold start, a step drafts only
    where the cost line went flat (some 240 steps of one shape, here), to measure its slope again."""
    clock = lambda rows, width: (PLAIN_SECONDS, 0.005 * width)  # noqa: E731
    free = World(clock, alpha=0.9).run(batch(1), 300)
    assert sum(any(ks) for _, ks in free[-100:]) > 80
    chosen = World(clock, alpha=0.9, max_step_ratio=1.2).run(batch(1), 1000)
    drafting = [step for step, (_, ks) in enumerate(chosen) if any(ks) and step >= 10]
    assert 3 <= len(drafting) <= 1000 // 200 and all(b - a >= 200 for a, b in zip([0] + drafting, drafting))
    probes = [step for step, (probe, _) in enumerate(chosen) if probe]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[-1] == PROBE_EVERY * FAR_BELOW_PROBES and all(b in (a, 2 * a) for a, b in zip(gaps, gaps[1:]))
