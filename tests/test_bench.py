"""``specdec bench``: harness, workloads, report files and CLI checks on tiny random models."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from specdec.bench import workloads
from specdec.bench.cli import register
from specdec.bench.hardware import device_bandwidth_gbs, direct_cost_ratio, forward_seconds, parameter_bytes
from specdec.bench.harness import BenchSettings, groups, run_benchmark
from specdec.bench.methods import (
    PEERS,
    MethodSpec,
    Runner,
    RunOutput,
    deterministic_modes,
    expand_methods,
    in_modes,
    methods,
)
from specdec.bench.report import degenerate_warning, mismatch_warning, repeats_short_run, to_markdown
from specdec.bench.summary import Calibration, ideal_ratio, metrics_cost_ratio, predicted_speedup
from specdec.bench.synthetic import RandomTokenPrompts, build_synthetic, random_questions, synthetic_config
from specdec.bench.workloads import PromptBuilder, Question, load_jsonl, load_spec_bench, load_workload
from specdec.drafters import DRAFTERS
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.errors import SpecDecError
from specdec.llm import LLM
from specdec.metrics import RequestMetrics

SPEC_BENCH = workloads.SPEC_BENCH_FILE
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="specdec")
    register(parser.add_subparsers())
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture
def extra_drafters(monkeypatch):
    """Two drafters registered for one test only: one that needs a model and one that does not."""

    class TwinDraft(DraftModelDrafter):
        method = "twin_draft"
        description = "a draft model under another name"

    class LookupCopy(NgramDrafter):
        method = "lookup_copy"
        description = "prompt lookup under another name"

    monkeypatch.setitem(DRAFTERS, TwinDraft.method, TwinDraft)
    monkeypatch.setitem(DRAFTERS, LookupCopy.method, LookupCopy)
    methods.cache_clear()
    yield
    methods.cache_clear()


# ---------------------------------------------------------------- formulas and method lists
def test_predicted_speedup_on_known_numbers():
    assert predicted_speedup(0.5, 2, 0.0) == pytest.approx(1.75)
    assert predicted_speedup(1.0, 4, 0.0) == pytest.approx(5.0)
    assert predicted_speedup(1.0, 4, 0.25) == pytest.approx(2.5)
    assert predicted_speedup(0.0, 3, 0.1) == pytest.approx(1 / 1.3)
    with pytest.raises(SpecDecError):
        predicted_speedup(1.5, 2, 0.0)


def test_ideal_ratio_of_a_draft_equal_to_the_target():
    assert ideal_ratio(4, 1.0, 1.0) == pytest.approx(1.0)  # a draft forward costs what the target's does
    assert ideal_ratio(4, 1.0, 1.2) == pytest.approx(5 / 5.2)
    assert ideal_ratio(1, 2.0, 2.0) == pytest.approx(1.0)
    with pytest.raises(SpecDecError):
        ideal_ratio(0, 1.0, 1.0)


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


def test_transformers_peers_run_only_at_integer_k():
    labels = [s.label for s in expand_methods(["draft_model", "hf_assisted"], [4, "auto"])]
    assert labels == ["plain", "draft_model k=4", "draft_model k=auto", "hf_assisted k=4"]
    with pytest.raises(SpecDecError, match="hf_assisted runs transformers at a fixed k"):
        expand_methods(["hf_assisted"], ["auto"])


def test_catalogue_is_plain_the_drafter_registry_and_the_peers(extra_drafters):
    catalogue = methods()
    assert list(catalogue) == ["plain", *DRAFTERS, *PEERS]
    for name, drafter in DRAFTERS.items():
        assert catalogue[name].speculative and not catalogue[name].peer
        assert catalogue[name].needs_draft == (drafter.draft_lm or drafter.staged)  # a stage defaults to it
        # a staged method needs its stages, a method whose model is a folder of heads needs its folder
        assert catalogue[name].needs_config == (drafter.staged or (drafter.needs_model and not drafter.draft_lm))
        assert drafter.description in catalogue[name].description
    assert catalogue["twin_draft"].needs_draft and not catalogue["lookup_copy"].needs_draft
    assert [s.label for s in expand_methods(["lookup_copy"], [3])] == ["plain", "lookup_copy k=3"]


# ---------------------------------------------------------------- workloads
def test_spec_bench_loader_reads_the_real_file():
    assert SPEC_BENCH.is_file(), f"the Spec-Bench question file is expected at {SPEC_BENCH} (shipped in the package)"
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
    """Returns a fixed function of each prompt, optionally with its last token changed; a call takes
    ``seconds`` whatever its size (so batching multiplies throughput) and is recorded in ``calls``."""

    def __init__(self, spec: MethodSpec, corrupt: bool = False, max_batch_size: int = 8) -> None:
        self.spec, self.corrupt, self.max_batch_size = spec, corrupt, max_batch_size
        self.calls: list[int] = []
        self.forgotten_after: list[int] = []  # the number of calls made when forget() was called

    def forget(self) -> None:
        self.forgotten_after.append(len(self.calls))

    def run(self, prompts: Sequence[Sequence[int]], max_tokens: int, temperature: float, seed: int) -> RunOutput:
        assert len(prompts) <= self.max_batch_size
        self.calls.append(len(prompts))
        outputs, all_metrics = [], []
        for prompt_ids in prompts:
            tokens = [(sum(prompt_ids) + i) % 50 for i in range(max_tokens)]
            if self.corrupt:
                tokens[-1] += 1
            metrics = None
            if self.spec.k is not None:
                metrics = RequestMetrics(time_drafting=0.01, time_target=0.02)
                for _ in range(max_tokens // 2):
                    metrics.record_step(self.spec.k, 1, 2)
            outputs.append(tokens)
            all_metrics.append(metrics)
        return RunOutput(outputs, 0.01 if self.spec.k else 0.02, all_metrics)

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
        ScriptedRunner(MethodSpec("hf"), max_batch_size=1),
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


class ModeRunner(ScriptedRunner):
    """A scripted runner whose call takes ``seconds``; in deterministic mode its tokens are shifted by one
    (the mode's numerics give other tokens than the default mode's)."""

    def __init__(self, spec: MethodSpec, seconds: float, corrupt: bool = False) -> None:
        super().__init__(spec, corrupt=corrupt)
        self.seconds = seconds

    def run(self, prompts: Sequence[Sequence[int]], max_tokens: int, temperature: float, seed: int) -> RunOutput:
        out = super().run(prompts, max_tokens, temperature, seed)
        shift = int(self.spec.deterministic)
        return RunOutput([[t + shift for t in tokens] for tokens in out.token_ids], self.seconds, out.metrics)


def test_both_modes_compare_each_variant_with_plain_decoding_in_its_mode():
    plain, ngram = MethodSpec("plain"), MethodSpec("ngram", 2)
    plain_det, ngram_det = MethodSpec("plain", deterministic=True), MethodSpec("ngram", 2, deterministic=True)
    assert (plain_det.label, ngram_det.label) == ("plain det", "ngram k=2 det")
    assert ngram_det.default_twin == "ngram k=2" and ngram.default_twin is None
    runners = [ModeRunner(plain, 0.02), ModeRunner(plain_det, 0.04), ModeRunner(ngram, 0.01),
               ModeRunner(ngram_det, 0.025, corrupt=True), ModeRunner(MethodSpec("hf"), 0.05)]
    result = run_benchmark(runners, QUESTIONS, ScriptedPrompts(), BenchSettings(max_tokens=8, warmup=0),
                           progress=False)
    # det variants are checked against plain det (whose tokens differ from plain's), the others against plain
    assert result.mismatches == {"ngram k=2 det": 3}
    assert {m.method: m.first_mismatch for m in result.measurements if m.matches_reference is False} == {
        "ngram k=2 det": 7}
    assert all(m.deterministic == m.method.endswith(" det") for m in result.measurements)
    overall = {r.label: r for r in result.summary if r.category == "overall"}
    assert overall["ngram k=2 det"].speedup == pytest.approx(0.04 / 0.025)  # against plain det
    assert overall["ngram k=2"].speedup == pytest.approx(2.0) and overall["hf"].speedup == pytest.approx(0.4)
    assert overall["plain det"].speedup == pytest.approx(1.0)
    assert overall["ngram k=2 det"].speedup_median == pytest.approx(0.04 / 0.025)
    assert overall["plain det"].deterministic_cost == pytest.approx(2.0)  # 0.04 s against 0.02 s
    assert overall["ngram k=2 det"].deterministic_cost == pytest.approx(2.5)
    assert [overall[label].deterministic_cost for label in ("plain", "ngram k=2", "hf")] == [None] * 3
    assert overall["plain det"].deterministic and not overall["hf"].deterministic
    markdown = to_markdown(result)
    assert "| speedup | det. cost |" in markdown and "| ngram k=2 det | 320.0 | 320.0 | 1.60x | 2.50x |" in markdown
    assert "| det. cost |" not in to_markdown(run_benchmark(runners[:1] + runners[2:3], QUESTIONS, ScriptedPrompts(),
                                                        BenchSettings(max_tokens=8, warmup=0), progress=False))


def test_a_deterministic_only_run_compares_peers_with_deterministic_plain_decoding():
    runners = [ModeRunner(MethodSpec("plain", deterministic=True), 0.04), ModeRunner(MethodSpec("hf"), 0.02)]
    result = run_benchmark(runners, QUESTIONS, ScriptedPrompts(), BenchSettings(max_tokens=8, warmup=0),
                           progress=False)
    overall = {r.label: r for r in result.summary if r.category == "overall"}
    assert overall["hf"].speedup == pytest.approx(2.0) and result.mismatches == {"hf": 3}
    assert "generations per method and batch size: 3" in to_markdown(result)


def test_each_mode_needs_its_plain_decoding():
    runners = [ScriptedRunner(MethodSpec("plain")), ScriptedRunner(MethodSpec("ngram", 2, deterministic=True))]
    with pytest.raises(SpecDecError, match="no plain det"):
        run_benchmark(runners, QUESTIONS, ScriptedPrompts(), BenchSettings(max_tokens=8), progress=False)
    with pytest.raises(SpecDecError, match="no deterministic mode"):
        MethodSpec("hf", deterministic=True)


def test_deterministic_modes_expand_specdec_methods_side_by_side():
    specs = expand_methods(["plain", "ngram", "hf"], [2, 4])
    assert [s.label for s in in_modes(specs, deterministic_modes("both"))] == [
        "plain", "plain det", "ngram k=2", "ngram k=2 det", "ngram k=4", "ngram k=4 det", "hf"]
    assert [s.label for s in in_modes(specs, deterministic_modes("on"))] == [
        "plain det", "ngram k=2 det", "ngram k=4 det", "hf"]
    assert in_modes(specs, deterministic_modes(None)) == specs == in_modes(specs, deterministic_modes("off"))
    with pytest.raises(SpecDecError, match="--deterministic takes off, on, both"):
        deterministic_modes("sometimes")


def test_a_bad_deterministic_mode_exits_2_with_one_line(capsys):
    from specdec.cli import main

    assert main(["bench", "--deterministic", "always", "--max-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["specdec bench: error: --deterministic takes off, on, both (alone: on), got 'always'"]


def test_method_order_rotates_and_sampling_skips_greedy_checks():
    runners = [ScriptedRunner(MethodSpec("plain")), ScriptedRunner(MethodSpec("hf"), corrupt=True)]
    settings = BenchSettings(max_tokens=4, temperature=0.7, seeds=(1, 2), warmup=0)
    result = run_benchmark(runners, QUESTIONS, ScriptedPrompts(), settings, progress=False)
    first = [m for m in result.measurements if m.turn == 0]
    assert [(m.seed, m.question_id, m.method, m.order) for m in first[:6]] == [
        (1, "1", "plain", 0),
        (1, "1", "hf", 1),
        (1, "2", "hf", 0),
        (1, "2", "plain", 1),
        (2, "1", "plain", 0),
        (2, "1", "hf", 1),
    ]
    assert result.mismatches == {} and all(m.matches_reference is None for m in result.measurements)


def test_units_run_pass_by_pass_and_each_pass_starts_forgotten():
    """Every group under one repeat and seed, then the next pass; runners forget what they learnt
    across requests after the warm-up and before every pass (3 calls a pass: two questions, one with
    two turns)."""
    runners = [ScriptedRunner(MethodSpec("plain"), max_batch_size=1), ScriptedRunner(MethodSpec("suffix", 2))]
    settings = BenchSettings(max_tokens=4, seeds=(1, 2), repeats=2, warmup=1)
    result = run_benchmark(runners, QUESTIONS, ScriptedPrompts(), settings, progress=False)
    passes = [(m.repeat, m.seed) for m in result.measurements if m.method == "plain" and m.turn == 0]
    assert passes == [(0, 1), (0, 1), (0, 2), (0, 2), (1, 1), (1, 1), (1, 2), (1, 2)]
    for runner in runners:
        assert runner.forgotten_after == [1, 4, 7, 10]  # one warm-up call, then 3 calls a pass


@pytest.mark.parametrize(("tokens", "expected"), [
    ([5] * 16, True),  # one token
    ([9, 9, 9, 9] + [7, 1] * 12, True),  # "#\n#\n...", after a different start
    ([4, 8, 15, 16, 23, 42, 3, 1] * 6, True),  # one line of 8 tokens, again and again
    ([4, 8, 15, 16, 23, 42, 3, 1, 2] * 6, False),  # a run of 9 is not short
    (list(range(40)), False),
    ([7, 1] * 3, False),  # too short to call it a repeat
    ([7, 1] * 12 + [5], False),  # broken at the end
])
def test_a_short_repeat_is_recognised(tokens, expected):
    assert repeats_short_run(tokens) is expected


class RepeatingRunner(ScriptedRunner):
    """Answers every prompt with the same two tokens over and over (a degenerate model)."""

    def run(self, prompts, max_tokens, temperature, seed):
        out = super().run(prompts, max_tokens, temperature, seed)
        return RunOutput([[7, 1] * (max_tokens // 2) for _ in prompts], out.seconds, out.metrics)


def test_degenerate_plain_output_draws_a_warning_in_the_report():
    settings = BenchSettings(max_tokens=16, warmup=0)
    runners = [RepeatingRunner(MethodSpec("plain")), RepeatingRunner(MethodSpec("ngram", 2))]
    result = run_benchmark(runners, QUESTIONS, ScriptedPrompts(), settings, progress=False)
    warning = degenerate_warning(result)
    assert warning.startswith("WARNING") and "3/3 generations" in warning
    assert warning in to_markdown(result)
    healthy = run_benchmark([ScriptedRunner(MethodSpec("plain"))], QUESTIONS, ScriptedPrompts(), settings,
                            progress=False)
    assert degenerate_warning(healthy) is None


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


MANY = [Question(f"a{i}", "a", (f"q{i}" * (i + 1),), "a") for i in range(5)] + [
    Question("b0", "b", ("x", "yy"), "b"),
    Question("b1", "b", ("zzz",), "b"),
]


def test_groups_cut_each_category_without_mixing():
    cut = groups(MANY, 2)
    assert [[q.question_id for q in g] for g in cut] == [["a0", "a1"], ["a2", "a3"], ["a4"], ["b0", "b1"]]
    assert len(groups(MANY, 8)) == 2 and len(groups(MANY, 1)) == len(MANY)


def test_batch_sizes_batch_turns_and_peers_run_at_batch_one_only():
    plain, ngram = ScriptedRunner(MethodSpec("plain")), ScriptedRunner(MethodSpec("ngram", 2), corrupt=True)
    peer = ScriptedRunner(MethodSpec("hf"), max_batch_size=1)
    settings = BenchSettings(max_tokens=4, warmup=1, batch_sizes=(1, 2))
    result = run_benchmark([plain, ngram, peer], MANY, ScriptedPrompts(), settings, progress=False)
    # batch 1: one call per turn (8 turns) plus a warm-up call; batch 2: warm-up, then a0+a1, a2+a3, a4,
    # b0+b1 (turn 0), b0 (turn 1).
    assert plain.calls == [1] + [1] * 8 + [2, 2, 2, 1, 2, 1]
    assert peer.calls == [1] * 9
    assert {m.batch_size for m in result.measurements if m.method == "hf"} == {1}
    at2 = [m for m in result.measurements if m.batch_size == 2 and m.method == "plain"]
    assert len(at2) == 8 and len({m.call for m in at2}) == 5
    assert sorted(m.call_size for m in at2) == [1, 1, 2, 2, 2, 2, 2, 2]
    # Greedy checks compare with plain at the same batch size: every ngram output is wrong, at both sizes.
    assert result.mismatches == {"ngram k=2": 16} and mismatch_warning(result).count("16/16") == 1
    rows = {(r.batch_size, r.label): r for r in result.summary if r.category == "overall"}
    assert (2, "hf") not in rows and (1, "hf") in rows
    # A call lasts 0.02 s (plain) whatever its size: throughput counts each call once.
    assert rows[1, "plain"].tokens_per_second == pytest.approx(4 / 0.02)
    assert rows[2, "plain"].tokens_per_second == pytest.approx(8 * 4 / (5 * 0.02))
    assert rows[2, "plain"].request_tokens_per_second == pytest.approx(4 / 0.02)
    assert rows[2, "plain"].num_calls == 5 and rows[2, "ngram k=2"].speedup == pytest.approx(2.0)
    assert rows[2, "plain"].steps_per_second == pytest.approx(5 * 4 / (5 * 0.02))
    assert rows[2, "plain"].roofline is None
    per_category = {(r.batch_size, r.category, r.label): r for r in result.summary}
    assert per_category[2, "b", "plain"].num_calls == 2
    markdown = to_markdown(result)
    assert "| 2 | ngram k=2 |" in markdown and "| 2 | hf |" not in markdown


def test_roofline_is_plain_steps_per_second_times_the_least_step_time():
    runners = [ScriptedRunner(MethodSpec("plain")), ScriptedRunner(MethodSpec("ngram", 2))]
    settings = BenchSettings(max_tokens=4, warmup=0, batch_sizes=(2,))
    calibration = Calibration(min_step_seconds=0.001, ideal_ratios={"ngram k=2": 1.5}, forward_seconds={1: 0.1, 3: 0.1})
    result = run_benchmark(runners, MANY[:4], ScriptedPrompts(), settings, calibration, progress=False)
    rows = {r.label: r for r in result.summary if r.category == "overall"}
    assert rows["plain"].roofline == pytest.approx(rows["plain"].steps_per_second * 0.001)
    assert rows["plain"].steps_per_second == pytest.approx(2 * 4 / (2 * 0.02))
    assert rows["ngram k=2"].roofline is None
    assert rows["ngram k=2"].ideal_speedup is None  # ideal ratios are batch-1 figures
    assert "roofline" in to_markdown(result) and "| 20.0% |" in to_markdown(result)


# ---------------------------------------------------------------- end to end on tiny models
def test_bench_cli_writes_reports_and_greedy_outputs_match(text_model_dirs, tmp_path):
    data = _write_jsonl(
        tmp_path / "q.jsonl",
        [{"prompt": "def f(x):\n    return"}, {"prompt": "for i in range"}, {"prompt": "x = 1"}],
    )
    out = tmp_path / "out"
    argv = ["--model", str(text_model_dirs["target"]), "--draft-model", str(text_model_dirs["draft"])]
    argv += ["--methods", "plain,draft_model,ngram,hf,hf_assisted,hf_prompt_lookup", "--k", "2"]
    argv += ["--workload", "jsonl", "--data", str(data), "--max-tokens", "8", "--dtype", "float64"]
    rc = _bench([*argv, "--batch-size", "1", "2", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    labels = ["plain", "draft_model k=2", "ngram k=2", "hf", "hf_assisted k=2", "hf_prompt_lookup k=2"]
    assert [m["label"] for m in report["methods"]] == labels
    assert report["settings"]["batch_sizes"] == [1, 2]
    measurements = report["measurements"]
    at1 = [m for m in measurements if m["batch_size"] == 1]
    at2 = [m for m in measurements if m["batch_size"] == 2]
    assert len(at1) == 3 * len(labels) and len(at2) == 3 * 3  # transformers peers only at batch 1
    assert sorted({m["call_size"] for m in at2}) == [1, 2]
    assert all(m["num_tokens"] == 8 and m["seconds"] > 0 for m in measurements)
    assert all(m["matches_reference"] for m in measurements if m["method"] != "plain")
    assert report["mismatches"] == {}
    overall = {(r["batch_size"], r["label"]): r for r in report["summary"] if r["category"] == "overall"}
    assert overall[1, "draft_model k=2"]["alpha"] == 1.0
    assert overall[2, "draft_model k=2"]["tau"] == pytest.approx(8 / 3)
    assert overall[1, "hf"]["tau"] is None and overall[1, "hf"]["speedup"] > 0
    assert overall[2, "plain"]["tokens_per_second"] > 0 and overall[2, "plain"]["request_tokens_per_second"] > 0
    assert (2, "hf") not in overall
    markdown = (out / "bench.md").read_text()
    assert "| 1 | hf_assisted k=2 |" in markdown and "| 2 | ngram k=2 |" in markdown
    assert "WARNING: greedy" not in markdown
    for name in ("speedup.png", "acceptance.png", "throughput.png"):
        assert (out / name).read_bytes().startswith(PNG_MAGIC)


def test_bench_cli_runs_both_modes_side_by_side(text_model_dirs, tmp_path):
    data = _write_jsonl(tmp_path / "q.jsonl", [{"prompt": "def f(x):\n    return"}, {"prompt": "x = 1"}])
    out = tmp_path / "out"
    rc = _bench(["--model", str(text_model_dirs["target"]), "--draft-model", str(text_model_dirs["draft"]),
                 "--methods", "plain,draft_model,hf", "--k", "2", "--deterministic", "both", "--workload", "jsonl",
                 "--data", str(data), "--max-tokens", "6", "--dtype", "float32", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["info"]["deterministic"] == "both"
    described = {m["label"]: m["deterministic"] for m in report["methods"]}  # the LLM's own mode
    assert described == {"plain": False, "plain det": True, "draft_model k=2": False, "draft_model k=2 det": True,
                         "hf": False}
    assert all(m["deterministic"] == m["method"].endswith(" det") for m in report["measurements"])
    assert all(m["matches_reference"] for m in report["measurements"] if not m["method"].startswith("plain"))
    overall = {r["label"]: r for r in report["summary"] if r["category"] == "overall"}
    tps = {label: row["tokens_per_second"] for label, row in overall.items()}
    assert overall["draft_model k=2 det"]["speedup"] == pytest.approx(tps["draft_model k=2 det"] / tps["plain det"])
    assert overall["draft_model k=2"]["speedup"] == pytest.approx(tps["draft_model k=2"] / tps["plain"])
    assert overall["hf"]["speedup"] == pytest.approx(tps["hf"] / tps["plain"])
    assert overall["plain det"]["deterministic_cost"] == pytest.approx(tps["plain"] / tps["plain det"])
    cost = tps["draft_model k=2"] / tps["draft_model k=2 det"]
    assert overall["draft_model k=2 det"]["deterministic_cost"] == pytest.approx(cost)
    assert overall["draft_model k=2 det"]["mismatches"] == 0 and overall["draft_model k=2"]["mismatches"] == 0
    costed = {label for label, row in overall.items() if row["deterministic_cost"]}
    assert costed == {"plain det", "draft_model k=2 det"}
    assert f"| 1 | draft_model k=2 det | {tps['draft_model k=2 det']:.1f} |" in (out / "bench.md").read_text()


def test_num_candidates_reaches_tree_methods_only(text_model_dirs, tmp_path):
    data = _write_jsonl(tmp_path / "q.jsonl", [{"prompt": "x = 1\nx = 1\nx = 1\n"}])
    out = tmp_path / "out"
    rc = _bench(["--model", str(text_model_dirs["target"]), "--draft-model", str(text_model_dirs["draft"]),
                 "--methods", "plain,ngram,draft_model", "--k", "4", "--num-candidates", "2", "--workload", "jsonl",
                 "--data", str(data), "--max-tokens", "8", "--dtype", "float64", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    configs = {m["label"]: m["speculative_config"] for m in report["methods"] if m["speculative_config"]}
    assert configs["ngram k=4"]["num_candidates"] == 2  # ngram proposes trees
    assert configs["draft_model k=4"]["num_candidates"] == 1  # a chain method runs as a chain
    assert all(m["matches_reference"] for m in report["measurements"] if m["method"] != "plain")


def test_auto_chooses_among_the_runs_other_methods(text_model_dirs, tmp_path):
    data = _write_jsonl(tmp_path / "q.jsonl", [{"prompt": "x = 1\nx = 1\nx = 1\n"}, {"prompt": "def f(x):\n"}])
    out = tmp_path / "out"
    rc = _bench(["--model", str(text_model_dirs["target"]), "--draft-model", str(text_model_dirs["draft"]),
                 "--methods", "plain,ngram,draft_model,layer_skip,auto", "--k", "3", "--workload", "jsonl",
                 "--data", str(data),
                 "--max-tokens", "8", "--dtype", "float64", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    auto = next(m for m in report["methods"] if m["label"] == "auto k=3")
    candidates = sorted(c["method"] for c in auto["speculative_config"]["candidates"])
    assert candidates == ["draft_model", "ngram"]  # layer_skip runs the target's own layers: not a candidate
    assert all(m["matches_reference"] for m in report["measurements"] if m["method"] != "plain")
    with pytest.raises(SpecDecError, match="other speculative methods"):
        _bench(["--model", str(text_model_dirs["target"]), "--methods", "plain,auto", "--workload", "jsonl",
                "--data", str(data), "--max-tokens", "4", "--out", str(tmp_path / "alone")])


def test_a_registered_drafter_is_benchmarked_with_no_change_to_the_bench(extra_drafters, text_model_dirs, tmp_path):
    data = _write_jsonl(tmp_path / "q.jsonl", [{"prompt": "def f(x):\n    return"}])
    out = tmp_path / "out"
    rc = _bench(
        ["--model", str(text_model_dirs["target"]), "--draft-model", str(text_model_dirs["draft"]),
         "--methods", "plain,twin_draft,lookup_copy", "--k", "2", "--workload", "jsonl", "--data", str(data),
         "--max-tokens", "6", "--dtype", "float64", "--warmup", "0", "--out", str(out)]
    )
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    configs = {m["label"]: m["speculative_config"] for m in report["methods"]}
    assert configs["twin_draft k=2"]["method"] == "twin_draft" and configs["twin_draft k=2"]["model"]
    assert configs["lookup_copy k=2"]["model"] is None
    overall = {r["label"]: r for r in report["summary"] if r["category"] == "overall"}
    assert overall["twin_draft k=2"]["alpha"] == 1.0 and overall["twin_draft k=2"]["mismatches"] == 0


def test_direct_cost_ratio_and_forward_seconds(text_model_dirs):
    config = {"method": "draft_model", "model": str(text_model_dirs["draft"]), "num_speculative_tokens": 2}
    llm = LLM(text_model_dirs["target"], speculative_config=config, dtype="float64", max_num_seqs=1)
    assert direct_cost_ratio(llm, list(range(1, 20)), trials=3) > 0
    assert forward_seconds(llm.target, [1, 2, 3], num_tokens=5, trials=2) > 0
    with pytest.raises(SpecDecError):
        direct_cost_ratio(LLM(text_model_dirs["target"], dtype="float64", max_num_seqs=1), [1, 2], trials=1)


# ---------------------------------------------------------------- synthetic models and the roofline
def test_synthetic_shapes_have_the_real_parameter_counts():
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        one = LlamaForCausalLM(synthetic_config("1b"))
        eight = LlamaForCausalLM(synthetic_config("8b"))
        draft = LlamaForCausalLM(synthetic_config("1b-2l", vocab_size=128256))
    assert sum(p.numel() for p in one.parameters()) == 1_123_117_056  # TinyLlama-1.1B with 8 KV heads
    assert sum(p.numel() for p in eight.parameters()) == 8_030_261_248  # Llama-3-8B
    assert draft.config.vocab_size == 128256 and draft.config.num_hidden_layers == 2
    with pytest.raises(SpecDecError):
        synthetic_config("2b")


def test_build_synthetic_fills_weights_on_the_device_in_its_dtype():
    from transformers import LlamaForCausalLM

    model = build_synthetic("test", torch.bfloat16, torch.device("cpu"), seed=3)
    reference = LlamaForCausalLM(synthetic_config("test"))
    assert model.dtype == torch.bfloat16 and model.config._name_or_path == "synthetic-test"
    assert parameter_bytes(model) == 2 * sum(p.numel() for p in reference.parameters())
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    weight = model.model.layers[0].mlp.up_proj.weight.float()
    assert abs(weight.std().item() - 0.02) < 0.002 and torch.all(model.model.norm.weight == 1)
    again = build_synthetic("test", torch.bfloat16, torch.device("cpu"), seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    draft = build_synthetic("test", torch.float32, torch.device("cpu"), seed=1, vocab_size=300, max_positions=64)
    assert draft.config.vocab_size == 300 and draft.lm_head.weight.shape == (300, 64)


def test_random_token_prompts_are_fixed_per_question():
    prompts = RandomTokenPrompts(vocab_size=50, prompt_len=7)
    questions = random_questions(3)
    first = [prompts.build(q.turns, []) for q in questions]
    assert all(len(ids) == 7 and all(0 <= t < 50 for t in ids) for ids in first)
    assert first == [prompts.build(q.turns, []) for q in questions] and first[0] != first[1]
    assert prompts.decode([1, 2]) == ""


def test_bandwidth_table_by_device_name(monkeypatch):
    assert device_bandwidth_gbs(torch.device("cpu")) is None
    for name, expected in [
        ("NVIDIA H100 80GB HBM3", 3350.0),
        ("NVIDIA H100 PCIe", 2000.0),
        ("NVIDIA H200", 4800.0),
        ("NVIDIA A100-SXM4-80GB", None),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert device_bandwidth_gbs(torch.device("cuda")) == expected


def test_synthetic_bench_with_the_target_as_its_own_draft(tmp_path):
    out = tmp_path / "out"
    rc = _bench(
        ["--synthetic", "test", "--draft-synthetic", "same", "--methods", "plain,draft_model", "--k", "2",
         "--num-prompts", "2", "--prompt-len", "16", "--max-tokens", "6", "--dtype", "float32",
         "--bandwidth-gbs", "1", "--batch-size", "1", "2", "--device", "cpu", "--out", str(out)]
    )
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["info"]["draft"] == "the target itself" and report["info"]["bandwidth GB/s"] == 1.0
    assert report["info"]["max model len"] == 16 + 6 + 3
    levels = {"DEFAULT", "AVX2", "AVX512", "NEON", "SVE256", "VSX", "ZVECTOR"}  # torch's CPU capabilities
    assert report["info"]["cpu features"].split(", ")[0] in levels
    assert all(m["prompt_tokens"] == 16 for m in report["measurements"])
    calibration = report["calibration"]
    assert set(calibration["forward_seconds"]) == {"1", "3"}
    assert calibration["min_step_seconds"] == pytest.approx(report["info"]["bytes read per step"] / 1e9)
    overall = {(r["batch_size"], r["label"]): r for r in report["summary"] if r["category"] == "overall"}
    assert overall[1, "draft_model k=2"]["alpha"] == 1.0
    ideal = calibration["ideal_ratios"]["draft_model k=2"]
    assert overall[1, "draft_model k=2"]["ideal_speedup"] == pytest.approx(ideal)
    assert overall[2, "draft_model k=2"]["ideal_speedup"] is None
    for size in (1, 2):
        plain = overall[size, "plain"]
        assert plain["roofline"] == pytest.approx(plain["steps_per_second"] * calibration["min_step_seconds"])
    markdown = (out / "bench.md").read_text()
    assert "## Draft equal to the target" in markdown and "| draft_model k=2 | 2 |" in markdown


@pytest.mark.parametrize(
    "argv",
    [
        ["--methods", "plain,warp_drive"],
        ["--k", "0"],
        ["--k", "65"],
        ["--k", "two"],
        ["--batch-size", "0"],
        ["--workload", "jsonl"],
        ["--workload", "jsonl", "--data", "/nonexistent/q.jsonl"],
        ["--prompt-lookup-min", "4", "--prompt-lookup-max", "2"],
        ["--num-candidates", "0"],
        ["--num-candidates", "17"],
        ["--max-tokens", "0"],
        ["--methods", "plain,hf_assisted"],
        ["--synthetic", "test"],
        ["--draft-synthetic", "tiny"],
        ["--draft-equals-target", "--draft-model", "x"],
        ["--max-model-len", "1"],
        ["--deterministic", "maybe"],
        ["--deterministic", "both", "--backend", "hf"],
    ],
)
def test_bad_inputs_raise_specdec_error(text_model_dirs, argv):
    with pytest.raises(SpecDecError):
        _bench(["--model", str(text_model_dirs["target"]), *argv])


def test_unknown_synthetic_shape_is_an_argument_error():
    with pytest.raises(SystemExit):
        _bench(["--synthetic", "70b"])


def test_missing_default_pair_is_reported(monkeypatch):
    import specdec.assets

    monkeypatch.setattr(specdec.assets, "default_pair", lambda: None)
    with pytest.raises(SpecDecError, match="embedded default pair"):
        _bench([])


def test_the_default_method_list_runs_on_any_target(capsys):
    """A bench without ``--methods`` runs what the target can: methods whose ``model`` is a folder of heads
    (eagle3) run only through ``--method-config``, and methods with trained default heads (eagle, medusa, mtp) are
    skipped with one line each on a target they were not trained for; the embedded target keeps them."""
    from transformers import AutoModelForCausalLM

    from specdec.assets import default_pair
    from specdec.bench.methods import REFERENCE, runnable_by_default
    from specdec.bench.synthetic import build_synthetic

    assert methods()["eagle3"].needs_config and not methods()["eagle3"].needs_draft
    assert methods()["draft_model"].needs_draft and not methods()["draft_model"].needs_config
    specs = [MethodSpec(REFERENCE), MethodSpec("eagle", 2), MethodSpec("eagle", 4), MethodSpec("medusa", 2),
             MethodSpec("ngram", 2), MethodSpec("eagle", 3, name="eagle-folder", overrides={"model": "/x"})]
    kept = runnable_by_default(specs, build_synthetic("test", torch.float32, torch.device("cpu")))
    assert [s.label for s in kept] == ["plain", "ngram k=2", "eagle-folder k=3"]
    err = capsys.readouterr().err
    assert err.count("skipping eagle: ") == 1 and "skipping medusa: " in err and "trained for the target" in err
    embedded = AutoModelForCausalLM.from_pretrained(default_pair()[0])
    assert runnable_by_default(specs, embedded) == specs
