"""The auto-k policy's choices as metrics: counted per request and per engine by a real run, exposed by the
server's ``/metrics`` (draft tokens per row and step, steps without drafts) and by the bench report."""

import json
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from specdec import LLM, SamplingParams
from specdec.bench.report import _columns, _k_choices
from specdec.engine import StepOutput
from specdec.server.metrics import ServerMetrics

PROMPTS = [[3, 5, 7, 3, 5, 7, 11, 3, 5], [42, 1, 17, 29, 8, 64, 2], [7], [90, 91, 90, 91, 90]]


def test_a_run_counts_the_policys_choices(model_dirs):
    dirs = model_dirs["llama"]
    spec = {"method": "draft_model", "model": str(dirs["truncated"]), "num_speculative_tokens": "auto"}
    llm = LLM(dirs["target"], speculative_config=spec, dtype="float64", max_num_seqs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=20))
    batch = llm.batch_metrics
    total: dict[int, int] = {}
    for out in outputs:
        for k, steps in out.metrics.k_choices.items():
            total[k] = total.get(k, 0) + steps
        # A row's last step may not draft (one token left): every other step is a choice.
        assert out.metrics.num_steps - 1 <= sum(out.metrics.k_choices.values()) <= out.metrics.num_steps
        drafted = sum(k * n for k, n in out.metrics.k_choices.items())
        assert drafted >= out.metrics.num_draft_tokens  # the drafter drafts at most what the policy chose
    assert total == batch.k_choices and all(k <= 8 for k in total)
    assert batch.num_speculation_off_steps <= batch.num_steps
    assert json.loads(json.dumps(batch.to_dict()))["k_choices"] == {str(k): n for k, n in total.items()}
    fixed = LLM(dirs["target"], speculative_config={**spec, "num_speculative_tokens": 3}, dtype="float64")
    fixed.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=10))
    assert fixed.batch_metrics.k_choices == {} and fixed.batch_metrics.num_speculation_off_steps == 0


def test_server_metrics_count_draft_lengths_and_steps_without_drafts():
    metrics = ServerMetrics("m")
    metrics.record_step([StepOutput("a", [1, 2, 3], 4, 2, None), StepOutput("b", [1], 0, 0, None)])
    metrics.record_step([StepOutput("a", [1], 0, 0, None), StepOutput("b", [1], 0, 0, None)])
    metrics.record_step([StepOutput("a", [1, 2], 2, 1, None)])
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}

    def value(name, **labels):
        return sum(v for (n, lab), v in samples.items() if n == name and all(dict(lab).get(k) == w
                                                                              for k, w in labels.items()))

    assert value("specdec:steps_without_drafts_total") == 1
    assert value("specdec:spec_decode_draft_tokens_per_step_count") == 5
    assert value("specdec:spec_decode_draft_tokens_per_step_sum") == 6
    assert value("specdec:spec_decode_draft_tokens_per_step_bucket", le="0.0") == 3
    assert value("specdec:spec_decode_draft_tokens_per_step_bucket", le="2.0") == 4


def test_bench_report_shows_the_policy_and_cascade_columns_only_when_filled():
    assert _k_choices({0: 1, 4: 3}) == "3.0 (25% off)"
    assert _k_choices(None) == "" and _k_choices({}) == ""
    plain = SimpleNamespace(roofline=None, ideal_speedup=None, inner_alpha=None, k_choices=None,
                            deterministic_cost=None)
    names = [name for name, _ in _columns([plain])]
    assert "auto k" not in names and "inner α" not in names
    auto = SimpleNamespace(roofline=None, ideal_speedup=None, inner_alpha=0.5, k_choices={2: 1},
                           deterministic_cost=None)
    names = [name for name, _ in _columns([plain, auto])]
    assert "auto k" in names and "inner α" in names
