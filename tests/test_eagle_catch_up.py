"""An EAGLE layer back from a pause catches up on its last ``catch_up_window`` pairs only
(:class:`specdec.drafters.heads.eagle.EagleDrafter`): what it feeds, what it reports as backlog, what its pool
registers for prefix caching, and that outputs stay exactly plain decoding's."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.assets import default_pair

PROMPTS = ["def quicksort(arr):\n    if len(arr) <= 1:\n", "class Stack:\n", "import os\n\ndef walk(path):\n"]


@pytest.fixture(scope="module")
def target():
    """The embedded target, whose embedded EAGLE heads are trained (their drafts are accepted), in float64."""
    return default_pair()[0]


def _llm(target, window: int, **kwargs) -> LLM:
    config = {"method": "eagle", "num_speculative_tokens": 2, **kwargs.pop("config", {})}
    llm = LLM(target, dtype="float64", max_num_seqs=4, speculative_config=config, **kwargs)
    llm.engine.drafter.catch_up_window = window
    return llm


def _submit(llm: LLM) -> None:
    prompt = llm.tokenizer(PROMPTS[0])["input_ids"]
    assert len(prompt) > 3  # past the window: the prompt is fed whole all the same
    llm.submit({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))


def _drafting(llm: LLM, on: bool) -> None:
    """Every row drafts 2 tokens (within its limit) on the following steps, or none."""
    llm.engine.policy.choose = lambda seqs, limits, *_: [min(2, limit) if on else 0 for limit in limits]


def test_a_row_back_from_a_pause_feeds_its_last_pairs_only(target):
    """A row that drafted, then sat out 9 steps, has 10 features buffered and reports a backlog of the window
    (3); its next proposal feeds the layer the pairs of the last 3 features, each with the token after it (the
    context's last 3 tokens), and the pool grows by 3; the 7 pairs left out are counted. A row that never sat out
    feeds everything, the prompt too (the window applies only after a pause)."""
    llm = _llm(target, 3)
    drafter = llm.engine.drafter
    _submit(llm)
    _drafting(llm, True)
    llm.step()
    seq = llm.scheduler.running[0]
    assert drafter.cache.lengths[seq.slot] == len(seq.prompt_ids) - 1 and drafter.skipped[seq.request_id] == 0
    _drafting(llm, False)
    for _ in range(9):
        llm.step()
    buffered = sum(part.shape[0] for part in drafter.features[seq.request_id])
    assert buffered >= 10 and drafter.backlog([seq]) == [3]
    before, fed = drafter.cache.lengths[seq.slot], []
    inputs = drafter._inputs
    drafter._inputs = lambda features, tokens: (fed.append(tokens.tolist()), inputs(features, tokens))[1]
    context = list(seq.token_ids)
    _drafting(llm, True)
    llm.step()
    assert fed[0] == context[-3:]  # pair j: feature of position j, token j + 1; the last pair ends in the pending one
    assert drafter.skipped[seq.request_id] == buffered - 3
    assert drafter.cache.lengths[seq.slot] == before + 3 + (len(seq.token_ids) - len(context) - 1)


@pytest.mark.parametrize("config", [{}, {"num_candidates": 2, "num_speculative_tokens": 4}],
                         ids=["chain", "tree"])
def test_outputs_after_pauses_equal_plain_decoding(target, config):
    """Rows that draft 3 steps, sit out 5, and so on, with a window of 2 pairs (most of each pause's pairs left
    out), give plain decoding's greedy outputs, chains and trees alike, and drafts are still accepted after
    the pauses."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(target, dtype="float64", max_num_seqs=4).generate(PROMPTS, params)
    llm = _llm(target, 2, config=config)
    steps = [0]

    def choose(seqs, limits, *_):
        steps[0] += 1
        return [min(config.get("num_speculative_tokens", 2), limit) if steps[0] % 8 < 3 else 0 for limit in limits]

    llm.engine.policy.choose = choose
    drafter, left_out = llm.engine.drafter, []
    commit = drafter._commit
    drafter._commit = lambda seqs, committed: (left_out.extend(drafter.skipped.values()), commit(seqs, committed))
    outputs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    assert max(left_out) >= 3 * 4  # pairs were left out (5 a pause a row, less the 2 kept)
    assert llm.batch_metrics.num_accepted_tokens > llm.batch_metrics.num_drafts  # and drafts accepted after them
    assert not llm.engine.drafter.skipped  # forgotten with the finished requests


def test_a_pool_with_pairs_left_out_registers_no_more_prefixes(target):
    """With prefix caching, the EAGLE pool registers its full blocks while its entries are every position's pair;
    once a pause left pairs out, its entries no longer follow the context's positions, and nothing more is
    registered for the row (a later context would otherwise find blocks of other pairs)."""
    llm = _llm(target, 2, enable_prefix_caching=True)
    drafter = llm.engine.drafter
    assert drafter.cache.caches_prefixes
    commits = []
    commit = drafter.cache.commit_prefix
    drafter.cache.commit_prefix = lambda slot, keys: (commits.append(slot), commit(slot, keys))
    _submit(llm)
    _drafting(llm, True)
    llm.step()
    assert commits  # registered while every position's pair is there
    _drafting(llm, False)
    for _ in range(6):
        llm.step()
    _drafting(llm, True)
    commits.clear()
    while llm.scheduler.has_work:
        llm.step()
    assert commits == []
