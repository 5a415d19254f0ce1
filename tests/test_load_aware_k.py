"""Speculation that knows the load: auto k decides per step from the rows actually running (drafting at
one row, off at a saturated batch, on again when the load falls), a vLLM-style
``num_speculative_tokens_per_batch_size`` schedule overrides it (checked, lossless), and the decisions
are reported by batch size in the engine's metrics and the server's ``/metrics``."""

import random

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_adaptive import FakeSeq, bernoulli_accepted

from specdec import LLM, SamplingParams
from specdec.adaptive import AdaptiveK
from specdec.drafters.base import SpeculativeConfig
from specdec.engine_metrics import PolicyCollector
from specdec.errors import SpecDecError
from specdec.k_schedule import ScheduledK
from specdec.metrics import BatchMetrics
from specdec.server.metrics import ServerMetrics
from specdec.step_cost import StepCost

PROMPTS = [[3, 5, 7, 3, 5, 7, 11, 3, 5], [42, 1, 17, 29, 8, 64, 2], [7, 8], [90, 91, 90, 91, 90], [1, 2, 3]]


def test_auto_k_follows_the_load():
    """One policy, the batch growing from 1 row to 64 and back, on a compute-bound clock (a CPU: every token
    fed costs 0.2 ms over a 2 ms step): it drafts at one row, switches off at 64 rows, and drafts again."""
    policy, rng, max_k, alpha = AdaptiveK(4), random.Random(0), 4, 0.8
    policy.bind_metrics(metrics := BatchMetrics())
    phases = []
    for rows in (1, 64, 1):
        seqs = [FakeSeq(f"{len(phases)}-{b}") for b in range(rows)]
        chosen = []
        for _ in range(300):
            ks = policy.choose(seqs, [max_k] * rows)
            accepted = bernoulli_accepted(ks, alpha, rng)
            fed = rows + sum(ks)
            policy.observe(seqs, ks, accepted, StepCost(fed, max(ks), 0.002 + 0.0002 * fed, 0.0005 * max(ks)))
            chosen.append(ks)
        for s in seqs:
            policy.release(s)
        phases.append(chosen[100:])
    one, full, again = phases
    assert sum(ks[0] > 0 for ks in one) > 0.85 * len(one)
    assert sum(sum(ks) == 0 for ks in full) > 0.85 * len(full)  # only the periodic probes draft
    assert sum(ks[0] > 0 for ks in again) > 0.85 * len(again)
    by_size = metrics.k_choices_by_batch_size
    assert set(by_size) == {1, 64}
    assert by_size[64].get(0, 0) > 0.85 * sum(by_size[64].values())
    assert by_size[1].get(0, 0) < 0.15 * sum(by_size[1].values())
    assert metrics.speculation_off_steps_by_batch_size[64] > 0.85 * 300 * 2 / 3
    assert sum(metrics.speculation_off_steps_by_batch_size.values()) == metrics.num_speculation_off_steps


@pytest.mark.parametrize("schedule", [{1: 3, 3: 1, 4: 0}, {"1": 3, "3": 1, "4": 0}, [[4, 0], [1, 3], [3, 1]]])
def test_schedule_forms(schedule):
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                          "num_speculative_tokens_per_batch_size": schedule})
    assert config.num_speculative_tokens_per_batch_size == ((1, 3), (3, 1), (4, 0))
    policy = ScheduledK(config.num_speculative_tokens_per_batch_size)
    assert [policy.k_for(rows) for rows in (1, 2, 3, 4, 64)] == [3, 3, 1, 0, 0]


@pytest.mark.parametrize("fields, message", [
    ({"num_speculative_tokens": "auto", "num_speculative_tokens_per_batch_size": {1: 2}}, "give one of them"),
    ({"num_speculative_tokens_per_batch_size": {2: 2}}, "must start at batch size 1"),
    ({"num_speculative_tokens_per_batch_size": {1: 5}}, r"integer in 0\.\.4 \(num_speculative_tokens\)"),
    ({"num_speculative_tokens_per_batch_size": {1: -1}}, r"integer in 0\.\.4"),
    ({"num_speculative_tokens_per_batch_size": {1: 0, 8: 0}}, "drafts at no batch size"),
    ({"num_speculative_tokens_per_batch_size": [[1, 2], [1, 3]]}, "gives batch size 1 twice"),
    ({"num_speculative_tokens_per_batch_size": {"x": 2}}, "batch size must be an integer"),
    ({"num_speculative_tokens_per_batch_size": 4}, "must map batch sizes to k"),
    ({"num_speculative_tokens_per_batch_size": {}}, "is empty"),
])
def test_bad_schedules(fields, message):
    with pytest.raises(SpecDecError, match=message):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, **fields})


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_schedule_in_a_run_is_lossless_and_counted(model_dirs, method):
    dirs = model_dirs["llama"]
    spec = {"method": method, "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": {1: 3, 3: 0}}
    if method == "draft_model":
        spec["model"] = str(dirs["truncated"])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = LLM(dirs["target"], dtype="float64", max_num_seqs=4).generate(prompts, params)
    llm = LLM(dirs["target"], speculative_config=spec, dtype="float64", max_num_seqs=4)
    scheduled = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in scheduled] == [o.outputs[0].token_ids for o in plain]
    batch = llm.batch_metrics
    sizes = batch.k_choices_by_batch_size
    assert {k for rows, ks in sizes.items() if rows >= 3 for k in ks} == {0}
    small = {k for rows, ks in sizes.items() if rows < 3 for k in ks}  # fewer than 3 near a request's end
    assert 3 in small and small <= {0, 1, 2, 3}
    assert set(batch.speculation_off_steps_by_batch_size) == {rows for rows in sizes if rows >= 3}
    assert batch.num_draft_tokens > 0 or method == "ngram"  # an n-gram lookup may find no match in random text


def test_server_metrics_report_the_decisions_by_batch_size():
    batch = BatchMetrics()
    batch.count_k_choices([2, 2, 0], [4, 4, 4])  # 3 rows
    batch.count_k_choices([0] * 5, [4] * 5)  # 5 rows: off
    batch.count_k_choices([0] * 6, [4] * 6)  # 6 rows: off, the same bucket (4)
    batch.count_k_choices([0], [0])  # nothing could draft: not a decision
    metrics = ServerMetrics("m")
    metrics.registry.register(PolicyCollector(batch, "m"))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}
    choices = {(dict(labels)["batch_size"], dict(labels)["k"]): v for (name, labels), v in samples.items()
               if name == "specdec:spec_decode_k_choices_total"}
    assert choices == {("2", "2"): 2, ("2", "0"): 1, ("4", "0"): 11}
    off = {dict(labels)["batch_size"]: v for (name, labels), v in samples.items()
           if name == "specdec:spec_decode_speculation_off_steps_total"}
    assert off == {"4": 2}
    assert batch.num_speculation_off_steps == 2 and batch.k_choices == {2: 2, 0: 12}
