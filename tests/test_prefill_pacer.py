"""A CPU server's default chunked prefill is paced by measured time: a step's prompt tokens add at most
``SHARE`` of a decoding step (at least ``MIN_PACED_CHUNK`` tokens, at most the token budget), a prompt token
priced by a fit of the steps' seconds to their prompt and decoding tokens, only while streams are running; a
budget given in tokens is kept as given; ``prefill_share`` sets another share where pacing applies and is refused
elsewhere; and pacing changes no output."""

import random
import statistics
from itertools import accumulate

import pytest
from helpers import build_model

from specdec import LLM, SamplingParams, SpecDecError
from specdec.prefill_pacer import DECAY, MIN_PACED_CHUNK, PROBE_EVERY, REACH, SHARE, PrefillPacer


def _pacer(steps: list[tuple[int, float]], decoding: int = 4, share: float = SHARE) -> PrefillPacer:
    pacer = PrefillPacer(share)
    for tokens, seconds in steps:
        pacer.observe(tokens, decoding, seconds)
    return pacer


def test_the_chunk_adds_a_share_of_a_decoding_step():
    # steps cost 6.05 ms + 0.1 ms a prompt token: SHARE * 6.05 / 0.1 = 30.25 tokens
    pacer = _pacer([(n, 0.00605 + 0.0001 * n) for n in (0, 16, 0, 128, 64, 0, 100, 32)])
    a, b = pacer.line()
    assert a == pytest.approx(0.00605) and b == pytest.approx(0.0001)
    assert pacer.budget(128, running=True) == int(SHARE * 60.5) == 30
    assert pacer.budget(20, running=True) == 20  # never above the token budget
    assert pacer.budget(128, running=False) == 128  # nobody's latency to keep: the whole budget


def test_another_share_scales_the_chunk_within_the_reach_and_the_cap():
    steps = [(n, 0.00605 + 0.0001 * n) for n in (0, 16, 0, 128, 64, 0, 100, 32)]
    widest = 128 * DECAY**4  # the most a recent step fed, four steps ago
    assert _pacer(steps, share=1.0).budget(512, running=True) == int(1.0 * 60.5) == 60
    assert _pacer(steps, share=0.25).budget(512, running=True) == int(0.25 * 60.5) == 15
    assert _pacer(steps, share=4.0).budget(512, running=True) == int(REACH * widest) == 208 < 4.0 * 60.5
    assert _pacer(steps, share=4.0).budget(100, running=True) == 100
    assert _pacer(steps, share=0.01).budget(512, running=True) == MIN_PACED_CHUNK  # the floor still moves a prompt


@pytest.mark.parametrize("bad", [0, -0.5, float("nan"), float("inf"), "1", True, None])
def test_a_share_that_is_not_a_positive_number_is_refused(bad):
    with pytest.raises(SpecDecError, match="prefill_share must be a number > 0"):
        PrefillPacer(bad)


def test_the_floor_and_the_cap():
    slow = _pacer([(n, 0.001 + 0.001 * n) for n in (0, 16, 0, 32)])  # a prompt token costs a whole step
    assert slow.budget(128, running=True) == MIN_PACED_CHUNK
    assert slow.budget(8, running=True) == 8
    fast = _pacer([(n, 0.5 + 0.0001 * n) for n in (0, 16, 0, 64)])
    assert fast.budget(128, running=True) == 128
    free = _pacer([(n, 0.005) for n in (0, 16, 0, 64)])  # prompt tokens measured free (a GPU's fused forward)
    assert free.line() == (pytest.approx(0.005), pytest.approx(0.0, abs=1e-12))


def test_a_prompt_token_measured_free_or_cheaper_than_nothing_gets_the_floor_not_the_budget():
    """Noisy steps whose prompt tokens come out cheaper than the decoding step without them: a token's price is
    never below 0, and 0 is no price, so the streams get the floor beside them, not the whole budget (at the ``1b``
    shape that took about five decoding steps)."""
    pacer = PrefillPacer()
    steps = [(0, 1, 0.010), (2, 1, 0.0102), (10, 1, 0.0099), (0, 4, 0.020), (2, 4, 0.0195), (10, 4, 0.0190),
             (0, 2, 0.013), (8, 2, 0.0128), (4, 3, 0.016), (6, 1, 0.0098)]
    for tokens, decoding, seconds in steps:
        pacer.observe(tokens, decoding, seconds)
    assert pacer.line()[1] == 0
    assert pacer.budget(128, running=True) == MIN_PACED_CHUNK
    assert pacer.budget(128, running=False) == 128
    free = _pacer([(n, 0.005) for n in (0, 16, 0, 64)])
    assert free.budget(128, running=True) == MIN_PACED_CHUNK


def test_a_probe_measures_the_decoding_step_then_the_floor_measures_a_token():
    """The first paced step feeds no prompt token; the next one, whose prompt tokens measure what a token adds
    to it, the floor (not the whole budget: the streams wait on that step too); then the paced chunk, reached by
    doubling."""
    fresh = PrefillPacer()
    assert fresh.line() is None and fresh.budget(128, running=True) == 0
    fresh.observe(0, 4, 0.005)
    assert fresh.line() is None and fresh.budget(128, running=True) == MIN_PACED_CHUNK
    assert fresh.budget(8, running=True) == 8
    assert _pacer([(16, 0.008)] * 3).line() is None  # prompt tokens never varied: nothing to price one by
    fresh.observe(MIN_PACED_CHUNK, 4, 0.005 + 0.0001 * MIN_PACED_CHUNK)
    assert fresh.line() == (pytest.approx(0.005), pytest.approx(0.0001))
    assert fresh.budget(128, running=True) == REACH * MIN_PACED_CHUNK < SHARE * 50
    fresh.observe(REACH * MIN_PACED_CHUNK, 4, 0.005 + 0.0001 * REACH * MIN_PACED_CHUNK)
    assert fresh.budget(128, running=True) == pytest.approx(SHARE * 50, abs=1)


def test_a_line_priced_cheap_on_small_chunks_is_not_extrapolated_far():
    """Noisy steps of up to 8 prompt tokens beside three streams at the ``1b`` shape priced a token at about 4 ms
    (it costs 15-17): the share would be 71 tokens, about 1.5 s where a step is 0.6 s. The next step feeds at most
    ``REACH`` times the most a recent step fed; once the wider steps measure the real price, the share applies."""
    pacer = _pacer([(0, 0.595), (8, 0.627), (0, 0.600), (4, 0.611), (0, 0.590), (8, 0.628)], decoding=3)
    a, b = pacer.line()
    assert SHARE * a / b > 60
    assert pacer.budget(512, running=True) == REACH * 8
    for tokens in (16, 0, 16, 16, 0, 16, 16, 16):
        pacer.observe(tokens, 3, 0.600 + 0.016 * tokens)
    a, b = pacer.line()
    assert b > 0.010 and pacer.budget(512, running=True) == int(SHARE * a / b) < REACH * 16


def _speculative_steps(seed: int, steps: int) -> list[tuple[int, int, float]]:
    """``(prompt tokens, decoding tokens, seconds)`` of a speculative server: 4 ms + 1 ms a decoding token +
    0.1 ms a prompt token, and the steps that feed prompts run more rows and drafts (as at saturation)."""
    rng, out = random.Random(seed), []
    for _ in range(steps):
        fed = rng.random() < 0.7
        tokens = rng.randrange(16, 65) if fed else 0
        decoding = rng.randrange(16, 41) if fed else rng.randrange(6, 25)
        out.append((tokens, decoding, 0.004 + 0.001 * decoding + 0.0001 * tokens))
    return out


def test_a_prompt_token_is_priced_apart_from_a_wider_decoding_step():
    """Steps feeding prompts verify more decoding tokens: the fit charges those to the decoding step, not to
    the prompt tokens (priced against the mean step without prompts, a token here would cost 0.3 ms)."""
    pacer = PrefillPacer()
    steps = _speculative_steps(0, 24)
    for tokens, decoding, seconds in steps:
        pacer.observe(tokens, decoding, seconds)
    a, b = pacer.line()
    assert b == pytest.approx(0.0001, rel=1e-6)
    plain_step = statistics.fmean(s for t, _, s in steps if t == 0)
    naive = statistics.fmean((s - plain_step) / t for t, _, s in steps if t)
    assert naive > 2 * b  # what the mean step without prompts would have made of it
    widest = max(t * DECAY ** age for age, (t, _, _) in enumerate(reversed(steps)))  # the chunks measured
    assert pacer.budget(1024, running=True) == min(int(SHARE * a / b), int(REACH * widest))


def test_until_two_widths_are_measured_a_decoding_token_is_priced_as_a_prompt_token():
    """Steps without prompts all at one width (ten rows) say nothing of what a decoding token adds; the steps
    feeding prompts run 10-14 rows. A decoding token is then priced as a prompt token (in a fused forward both
    are one more token through the same weights), solved together: here exactly the cost."""
    pacer = PrefillPacer()
    for i in range(24):
        tokens, decoding = (0, 10) if i % 4 == 0 else (16 * (i % 4), 10 + i % 5)
        pacer.observe(tokens, decoding, 0.002 + 0.0002 * (decoding + tokens))
    assert pacer.decoding_step() is None
    assert pacer.line() == (pytest.approx(0.002 + 0.0002 * pacer._last_rows), pytest.approx(0.0002))


def test_one_slow_step_without_prompts_does_not_cheapen_a_prompt_token():
    """At saturation one step in ``PROBE_EVERY`` feeds no prompt. One that the machine slowed 1.7x (64 streams at
    the ``1b`` shape) took a joint least-squares fit's price of a token from 19 ms to 7-11 ms, and the chunks from
    19 to 89 tokens. Measured apart with medians, it moves neither the decoding step nor the price."""
    def cost(rows: int, tokens: int) -> float:
        return 0.35 + 0.019 * (rows + tokens)

    pacer = PrefillPacer()
    for i in range(8 * PROBE_EVERY):
        rows = 12 + i // PROBE_EVERY  # the load grows: the decoding step is measured at several widths
        tokens = pacer.budget(64, running=True)
        slow = tokens == 0 and i > 6 * PROBE_EVERY  # the first probe after six periods: the machine slowed
        pacer.observe(tokens, rows, (1.7 if slow else 1.0) * cost(rows, tokens))
        if slow:
            break
    assert slow  # the old fit: b 2.8 ms and 34 tokens here
    a, b = pacer.line()
    assert a == pytest.approx(cost(rows, 0), rel=0.02) and b == pytest.approx(0.019, rel=0.02)
    assert pacer.budget(64, running=True) <= int(SHARE * cost(rows, 0) / 0.019 * 1.05)


def test_a_step_s_drafts_are_not_charged_to_its_prompt_tokens_nor_widen_their_share():
    """The drafter's seconds are timed apart and the drafts verified are decoding tokens: a step that drafted and
    fed prompts prices a prompt token at what it adds, and the share is of plain decoding's step at the last
    step's rows, so a drafting step gives the prompts what a plain step at those rows would."""
    drafted, plain = PrefillPacer(), PrefillPacer()
    for i in range(24):
        tokens, rows = (0 if i % 3 == 0 else 16), 8 + i % 4  # the decoding step measured at 8-11 rows
        drafts, drafting = (rows, 0.05) if tokens else (0, 0.0)  # only the steps feeding prompts draft (a ramp)
        drafted.observe(tokens, rows + drafts, 0.3 + 0.02 * (rows + drafts) + 0.02 * tokens + drafting, drafting,
                        drafts)
        plain.observe(tokens, rows, 0.3 + 0.02 * rows + 0.02 * tokens)
    assert drafted.decoding_step() == (pytest.approx(0.3), pytest.approx(0.02))
    a, b = drafted.line()
    assert b == pytest.approx(0.02) and a == pytest.approx(0.3 + 0.02 * 11)  # the last step: 11 rows, 11 drafts
    assert drafted.budget(256, running=True) == plain.budget(256, running=True) == int(SHARE * a / b)


def test_under_a_flood_a_probe_every_period():
    """Prompts at every step: every ``PROBE_EVERY`` steps one feeds none; a load that grows (more rows
    decoding) is read as a dearer decoding step, not as dearer prompt tokens."""
    pacer = _pacer([(n, 0.002 + 0.001 * 4 + 0.0001 * n) for n in (0, 16, 0, 32)])
    budgets = []
    for _ in range(3 * PROBE_EVERY):
        budgets.append(pacer.budget(128, running=True))
        decoding = 10 if 0 in budgets else 4  # more streams from the first probe on
        pacer.observe(budgets[-1], decoding, 0.002 + 0.001 * decoding + 0.0001 * budgets[-1])
    probes = [i for i, b in enumerate(budgets) if b == 0]
    assert len(probes) == 2 and probes[1] - probes[0] == PROBE_EVERY + 1
    a, b = pacer.line()
    assert a == pytest.approx(0.012, rel=0.05) and b == pytest.approx(0.0001, rel=0.05)


def test_measurements_decay():
    """Later measurements outweigh earlier ones: the load and the machine's speed change while it serves."""
    pacer = _pacer([(n, 0.010 + 0.0002 * n) for n in (0, 16, 0, 32)])
    for _ in range(80):
        for n in (0, 16):
            pacer.observe(n, 4, 0.002 + 0.0001 * n)
    a, b = pacer.line()
    assert a == pytest.approx(0.002, rel=0.05) and b == pytest.approx(0.0001, rel=0.05)


@pytest.fixture(scope="module")
def target():
    return build_model("llama", seed=7)


def test_pacing_is_a_cpu_servers_default_only(target):
    """A server paces its 128-token budget; offline, a batch's prompts go in 128-token chunks unpaced."""
    served = LLM(target, dtype="float64", backend="fast", serving=True)
    assert served.scheduler.pacer is not None and served.max_num_batched_tokens == 128
    offline = LLM(target, dtype="float64", backend="fast")
    assert offline.scheduler.pacer is None and offline.max_num_batched_tokens == 128
    given = LLM(target, dtype="float64", backend="fast", serving=True, max_num_batched_tokens=256)
    assert given.scheduler.pacer is None and given.max_num_batched_tokens == 256
    assert LLM(target, dtype="float64", backend="fast", serving=True, enable_chunked_prefill=False).scheduler.pacer \
        is None
    assert served.prefill_share == SHARE == served.scheduler.pacer.share


def test_prefill_share_sets_the_pacer_s_share_where_it_paces_and_is_refused_elsewhere(target):
    wider = LLM(target, dtype="float64", backend="fast", serving=True, prefill_share=1.5)
    assert wider.prefill_share == 1.5 and wider.scheduler.pacer.share == 1.5
    for settings, why in (({}, r"this is not a server \(serving=False\)"),
                          ({"serving": True, "max_num_batched_tokens": 256}, "max_num_batched_tokens is given"),
                          ({"serving": True, "enable_chunked_prefill": False}, "chunked prefill is off")):
        with pytest.raises(SpecDecError, match=f"prefill_share paces .*nothing is paced \\({why}\\): drop it"):
            LLM(target, dtype="float64", backend="fast", prefill_share=1.0, **settings)
    with pytest.raises(SpecDecError, match="prefill_share must be a number > 0"):
        LLM(target, dtype="float64", backend="fast", serving=True, prefill_share=-1)


class _Fixed:
    """A pacer that always grants ``tokens`` while streams run (the scheduler's side of pacing)."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def observe(self, tokens: int, decoding: int, seconds: float, drafting: float = 0.0, drafted: int = 0) -> None:
        pass

    def budget(self, cap: int, running: bool) -> int:
        return min(cap, self.tokens) if running else cap


def _serve(llm: LLM, pace: int | None) -> tuple[list[list[int]], list[int]]:
    """Two running streams and a long prompt arriving beside them: every output, and the long prompt's
    cached length after each step until it runs."""
    if pace is not None:
        llm.scheduler.pacer = _Fixed(pace)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    short = [llm.submit({"prompt_token_ids": [3 + i, 4, 5]}, params) for i in range(2)]
    llm.step()
    long = llm.submit({"prompt_token_ids": [(7 * i) % 90 + 1 for i in range(100)]}, params)
    tokens = {h.seq.request_id: [] for h in (*short, long)}
    fed = []
    while llm.scheduler.has_work:
        for out in llm.step():
            tokens[out.request_id] += out.token_ids
        if long.seq.slot >= 0 and long.seq not in llm.scheduler.running:
            fed.append(llm.engine.cache.lengths[long.seq.slot])
    return list(tokens.values()), fed


@pytest.mark.parametrize("backend", ["fast", "hf"])
def test_the_scheduler_feeds_the_paced_chunks_and_outputs_do_not_change(target, backend):
    """Fused into the decoding step's forward (fast backend) or fed apart (transformers), the same chunks."""
    paced, fed = _serve(LLM(target, dtype="float64", backend=backend, max_num_seqs=4), 16)
    assert fed[:3] == [16, 32, 48]  # one block a step beside the two streams
    whole, _ = _serve(LLM(target, dtype="float64", backend=backend, max_num_seqs=4, enable_chunked_prefill=False),
                      None)
    assert paced == whole


def test_a_real_pacer_observes_every_step_that_ran_streams(target):
    """The scheduler reports every step that ran streams to the pacer, with the prompt tokens that step fed: a
    probe first (none), then the floor until a prompt token's cost is measured, and the long prompt's 99
    context tokens in all (the pending one is fed by its first step), as its cached length grew."""
    llm = LLM(target, dtype="float64", backend="fast", max_num_seqs=4, serving=True)
    observed, ran_streams = [], []
    observe = llm.scheduler.pacer.observe
    llm.scheduler.pacer.observe = lambda tokens, *rest: observed.append(tokens) or observe(tokens, *rest)
    step = llm.step
    llm.step = lambda: ran_streams.append(bool(llm.scheduler.running)) or step()
    _, fed = _serve(llm, None)
    assert len(observed) == sum(ran_streams) > 2
    assert observed[:2] == [0, MIN_PACED_CHUNK]
    assert sum(observed) == 99 and all(0 <= n <= 128 for n in observed)
    assert fed == list(accumulate(observed))[: len(fed)]
