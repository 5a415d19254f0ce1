"""A CPU server's default chunked prefill is paced by measured time: a step's prompt tokens are those
whose fitted prefill cost fits within a decoding step (at least one block, at most the token budget),
only while streams are running; a budget given in tokens is kept as given; and pacing changes no output."""

import pytest
from helpers import build_model

from specdec import LLM, SamplingParams
from specdec.prefill_pacer import MIN_PACED_CHUNK, PrefillPacer


def _pacer(prefills: list[tuple[int, float]], step: float) -> PrefillPacer:
    pacer = PrefillPacer()
    for tokens, seconds in prefills:
        pacer.observe_prefill(tokens, seconds)
    pacer.observe_step(step)
    return pacer


def test_the_chunk_is_what_fits_in_a_decoding_step():
    # prefills cost 2 ms + 0.1 ms a token; a decoding step 6.05 ms: (6.05 - 2) / 0.1 = 40.5 tokens
    pacer = _pacer([(n, 0.002 + 0.0001 * n) for n in (16, 128, 64, 100, 32)], 0.00605)
    a, b = pacer.line()
    assert a == pytest.approx(0.002) and b == pytest.approx(0.0001)
    assert pacer.budget(128, running=True) == 40
    assert pacer.budget(30, running=True) == 30  # never above the token budget
    assert pacer.budget(128, running=False) == 128  # nobody's latency to keep: the whole budget


def test_the_floor_and_the_cap():
    pacer = _pacer([(n, 0.002 + 0.0001 * n) for n in (16, 128, 64)], 0.001)
    assert pacer.budget(128, running=True) == MIN_PACED_CHUNK  # even one block costs more than a step
    assert pacer.budget(8, running=True) == 8
    fast = _pacer([(n, 0.0001 * n) for n in (16, 128, 64)], 0.5)
    assert fast.budget(128, running=True) == 128


def test_one_chunk_size_prices_every_token_at_the_mean():
    # without spread there is no slope: 12.8 ms / 128 tokens, and a 6.05 ms step takes 60 tokens
    pacer = _pacer([(128, 0.0128)] * 3, 0.00605)
    assert pacer.line() == (0.0, pytest.approx(0.0001))
    assert pacer.budget(128, running=True) == 60


def test_nothing_measured_is_the_whole_budget():
    pacer = PrefillPacer()
    assert pacer.line() is None and pacer.budget(128, running=True) == 128
    pacer.observe_prefill(0, 0.5)  # a step that fed no prompt token measures nothing
    assert pacer.line() is None


def test_measurements_decay():
    """Later measurements outweigh earlier ones: the machine's speed changes while it serves."""
    pacer = _pacer([], 0.010)
    for _ in range(60):
        pacer.observe_step(0.002)
    assert pacer.step_seconds == pytest.approx(0.002, rel=0.05)


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


class _Fixed:
    """A pacer that always grants ``tokens`` while streams run (the scheduler's side of pacing)."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def observe_step(self, seconds: float) -> None:
        pass

    def observe_prefill(self, tokens: int, seconds: float) -> None:
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


def test_the_scheduler_feeds_the_paced_chunks_and_outputs_do_not_change(target):
    paced, fed = _serve(LLM(target, dtype="float64", backend="fast", max_num_seqs=4), MIN_PACED_CHUNK)
    assert fed[:3] == [16, 32, 48]  # one block a step beside the two streams
    whole, _ = _serve(LLM(target, dtype="float64", backend="fast", max_num_seqs=4, enable_chunked_prefill=False),
                      None)
    assert paced == whole
