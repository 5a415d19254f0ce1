"""``specdec bench``: harness, workloads, report files and CLI checks on tiny random models."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from specdec.bench import workloads
from specdec.bench.cli import register
from specdec.bench.harness import (
    BenchSettings,
    MethodSpec,
    expand_methods,
    metrics_cost_ratio,
    predicted_speedup,
    run_benchmark,
)
from specdec.bench.report import mismatch_warning, to_markdown
from specdec.bench.runners import Runner, RunOutput, direct_cost_ratio
from specdec.bench.workloads import PromptBuilder, Question, load_jsonl, load_spec_bench, load_workload
from specdec.errors import SpecDecError
from specdec.llm import LLM
from specdec.metrics import RequestMetrics

SPEC_BENCH = workloads.repo_root() / workloads.SPEC_BENCH_RELATIVE
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="specdec")
    register(parser.add_subparsers())
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


# ---------------------------------------------------------------- formulas and method lists
def test_predicted_speedup_on_known_numbers():
    assert predicted_speedup(0.5, 2, 0.0) == pytest.approx(1.75)
    assert predicted_speedup(1.0, 4, 0.0) == pytest.approx(5.0)
    assert predicted_speedup(1.0, 4, 0.25) == pytest.approx(2.5)
    assert predicted_speedup(0.0, 3, 0.1) == pytest.approx(1 / 1.3)
    with pytest.raises(SpecDecError):
        predicted_speedup(1.5, 2, 0.0)


def test_metrics_cost_ratio_is_draft_time_per_token_over_target_time_per_step():
    metrics = RequestMetrics(num_steps=4, num_draft_tokens=8, time_drafting=0.8, time_target=2.0)
    assert metrics_cost_ratio(metrics) == pytest.approx((0.8 / 8) / (2.0 / 4))
    assert metrics_cost_ratio(RequestMetrics(num_steps=4, time_target=1.0)) is None


def test_expand_methods_runs_plain_first_and_speculative_methods_once_per_k():
    specs = expand_methods(["ngram", "hf", "draft_model"], [2, 4])
    assert [s.label for s in specs] == [
        "plain",
        "ngram k=2",
        "ngram k=4",
        "hf",
        "draft_model k=2",
        "draft_model k=4",
    ]
    for names, ks in ((["nope"], [2]), (["ngram"], [0]), (["ngram"], [65]), (["ngram"], [])):
        with pytest.raises(SpecDecError):
            expand_methods(names, ks)
    with pytest.raises(SpecDecError):
        MethodSpec("ngram")


# ---------------------------------------------------------------- workloads
def test_spec_bench_loader_reads_the_real_file():
    assert SPEC_BENCH.is_file(), f"the Spec-Bench question file is expected at {SPEC_BENCH} (../shared beside the repo)"
    questions = load_spec_bench()
    assert len(questions) == 480
    categories = {q.category for q in questions}
    assert categories == {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}
    assert sum(len(q.turns) == 2 for q in questions) == 80
    few = load_spec_bench(num_prompts=8)
    assert len(few) == 6 * 8
    assert len({q.subcategory for q in few if q.category == "mt_bench"}) == 8
    assert {q.category for q in load_workload("spec_bench", SPEC_BENCH, ["qa", "rag"], 3)} == {"qa", "rag"}


def test_jsonl_loader_reads_prompt_and_turns_rows(tmp_path):
    path = _write_jsonl(
        tmp_path / "q.jsonl",
        [
            {"prompt": "def f(x):"},
            {"turns": ["for i in range(3):", "print(i)"], "category": "loops", "id": 7},
            {"prompt": "x = 1"},
        ],
    )
    questions = load_jsonl(path)
    assert [q.category for q in questions] == ["default", "loops", "default"]
    assert questions[1] == Question("7", "loops", ("for i in range(3):", "print(i)"), "loops")
    assert len(load_jsonl(path, num_prompts=1)) == 2
    assert [q.question_id for q in load_jsonl(path, categories=["loops"])] == ["7"]


@pytest.mark.parametrize("rows", [[{"text": "no prompt"}], [{"turns": []}], [{"prompt": ""}], []])
def test_jsonl_loader_rejects_bad_rows(tmp_path, rows):
    with pytest.raises(SpecDecError):
        load_jsonl(_write_jsonl(tmp_path / "bad.jsonl", rows))


def test_prompt_builder_joins_turns_or_applies_the_chat_template(text_model_dirs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(text_model_dirs["target"])
    plain = PromptBuilder(tokenizer)
    ids = plain.build(["def f(x):", "for i in x:"], ["return x"])
    assert plain.decode(ids) == "def f(x):\n\nreturn x\n\nfor i in x:"
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}[a]{% endif %}"
    )
    chat = PromptBuilder(tokenizer)
    assert chat.decode(chat.build(["x", "y"], ["z"])) == "[user]x[assistant]z[user]y[a]"
    with pytest.raises(SpecDecError):
        chat.build(["x", "y"], [])


# ---------------------------------------------------------------- harness with scripted runners
class ScriptedRunner(Runner):
    """Returns a fixed function of the prompt, optionally with its last token changed."""

    def __init__(self, spec: MethodSpec, corrupt: bool = False) -> None:
        self.spec, self.corrupt = spec, corrupt

    def run(self, prompt_ids: Sequence[int], max_tokens: int, temperature: float, seed: int) -> RunOutput:
        tokens = [(sum(prompt_ids) + i) % 50 for i in range(max_tokens)]
        if self.corrupt:
            tokens[-1] += 1
        metrics = None
        if self.spec.k is not None:
            metrics = RequestMetrics(time_drafting=0.01, time_target=0.02)
            for _ in range(max_tokens // 2):
                metrics.record_step(self.spec.k, 1, 2)
        return tokens, 0.01 if self.spec.k else 0.02, metrics

    def describe(self) -> dict:
        return {"label": self.spec.label}


class ScriptedPrompts:
    def build(self, turns: Sequence[str], answers: Sequence[str]) -> list[int]:
        return [len(t) for t in turns] + [len(a) for a in answers]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "a" * len(token_ids)


QUESTIONS = [Question("1", "one", ("abc",), "one"), Question("2", "two", ("de", "fgh"), "two")]


def test_corrupted_output_is_flagged_as_a_mismatch():
    runners = [
        ScriptedRunner(MethodSpec("plain")),
        ScriptedRunner(MethodSpec("ngram", 2), corrupt=True),
        ScriptedRunner(MethodSpec("hf")),
    ]
    result = run_benchmark(
        runners, QUESTIONS, ScriptedPrompts(), BenchSettings(max_tokens=8, warmup=1), progress=False
    )
    assert result.mismatches == {"ngram k=2": 3}
    bad = [m for m in result.measurements if m.method == "ngram k=2"]
    assert all(m.matches_reference is False and m.first_mismatch == 7 for m in bad)
    assert all(m.matches_reference for m in result.measurements if m.method == "hf")
    warning = mismatch_warning(result)
    assert warning.startswith("WARNING") and "ngram k=2: 3/3" in warning
    assert warning in to_markdown(result)
    overall = {r.label: r for r in result.summary if r.category == "overall"}
    assert overall["ngram k=2"].speedup == pytest.approx(2.0)
    assert overall["ngram k=2"].alpha == pytest.approx(0.5)
    assert overall["ngram k=2"].cost_ratio == pytest.approx((0.01 / 8) / (0.02 / 4))
    assert overall["ngram k=2"].predicted_speedup == pytest.approx(predicted_speedup(0.5, 2, 0.25))
    assert overall["hf"].tau is None and overall["hf"].mismatches == 0


def test_method_order_rotates_and_sampling_skips_greedy_checks():
    runners = [ScriptedRunner(MethodSpec("plain")), ScriptedRunner(MethodSpec("hf"), corrupt=True)]
    settings = BenchSettings(max_tokens=4, temperature=0.7, seeds=(1, 2), warmup=0)
    result = run_benchmark(runners, QUESTIONS, ScriptedPrompts(), settings, progress=False)
    first = [m for m in result.measurements if m.turn == 0]
    assert [(m.seed, m.method, m.order) for m in first[:4]] == [
        (1, "plain", 0),
        (1, "hf", 1),
        (2, "hf", 0),
        (2, "plain", 1),
    ]
    assert result.mismatches == {} and all(m.matches_reference is None for m in result.measurements)


def test_prompts_beyond_the_context_window_are_skipped():
    runners = [ScriptedRunner(MethodSpec("plain"))]
    settings = BenchSettings(max_tokens=4, context_window=6, warmup=0)
    result = run_benchmark(runners, QUESTIONS, ScriptedPrompts(), settings, progress=False)
    assert [(s["question_id"], s["turn"]) for s in result.skipped] == [("2", 1)]
    with pytest.raises(SpecDecError):
        run_benchmark(
            runners,
            QUESTIONS,
            ScriptedPrompts(),
            BenchSettings(max_tokens=8, context_window=4),
            progress=False,
        )


# ---------------------------------------------------------------- end to end on tiny models
def test_bench_cli_writes_reports_and_greedy_outputs_match(text_model_dirs, tmp_path):
    data = _write_jsonl(
        tmp_path / "q.jsonl", [{"prompt": "def f(x):\n    return"}, {"prompt": "for i in range"}]
    )
    out = tmp_path / "out"
    rc = _bench(
        [
            "--model",
            str(text_model_dirs["target"]),
            "--draft-model",
            str(text_model_dirs["draft"]),
            "--methods",
            "plain,draft_model,ngram,hf,hf_assisted,hf_prompt_lookup",
            "--k",
            "2",
            "--workload",
            "jsonl",
            "--data",
            str(data),
            "--max-tokens",
            "8",
            "--dtype",
            "float64",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    labels = ["plain", "draft_model k=2", "ngram k=2", "hf", "hf_assisted k=2", "hf_prompt_lookup k=2"]
    assert [m["label"] for m in report["methods"]] == labels
    assert len(report["measurements"]) == 2 * len(labels)
    assert all(m["num_tokens"] == 8 and m["seconds"] > 0 for m in report["measurements"])
    assert all(m["matches_reference"] for m in report["measurements"] if m["method"] != "plain")
    assert report["mismatches"] == {}
    overall = {r["label"]: r for r in report["summary"] if r["category"] == "overall"}
    assert overall["draft_model k=2"]["alpha"] == 1.0 and overall["draft_model k=2"]["tau"] == pytest.approx(
        8 / 3
    )
    assert overall["hf"]["tau"] is None and overall["hf"]["speedup"] > 0
    markdown = (out / "bench.md").read_text()
    assert "| hf_assisted k=2 |" in markdown and "WARNING" not in markdown
    for name in ("speedup.png", "acceptance.png"):
        assert (out / name).read_bytes().startswith(PNG_MAGIC)


def test_direct_cost_ratio_times_single_token_forwards(text_model_dirs):
    config = {"method": "draft_model", "model": str(text_model_dirs["draft"]), "num_speculative_tokens": 2}
    llm = LLM(text_model_dirs["target"], speculative_config=config, dtype="float64")
    assert direct_cost_ratio(llm, list(range(1, 20)), trials=3) > 0
    with pytest.raises(SpecDecError):
        direct_cost_ratio(LLM(text_model_dirs["target"], dtype="float64"), [1, 2], trials=1)


@pytest.mark.parametrize(
    "argv",
    [
        ["--methods", "plain,warp_drive"],
        ["--k", "0"],
        ["--k", "65"],
        ["--k", "two"],
        ["--workload", "jsonl"],
        ["--workload", "jsonl", "--data", "/nonexistent/q.jsonl"],
        ["--prompt-lookup-min", "4", "--prompt-lookup-max", "2"],
        ["--max-tokens", "0"],
        ["--methods", "plain,hf_assisted"],
    ],
)
def test_bad_inputs_raise_specdec_error(text_model_dirs, argv):
    with pytest.raises(SpecDecError):
        _bench(["--model", str(text_model_dirs["target"]), *argv])


def test_missing_default_pair_is_reported(monkeypatch):
    import specdec.assets

    monkeypatch.setattr(specdec.assets, "default_pair", lambda: None)
    with pytest.raises(SpecDecError, match="embedded default pair"):
        _bench([])
