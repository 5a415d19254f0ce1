"""Bench reporting from a first run: per-prompt medians with their spread, a warning when plain
decoding's timings are unreliable, no plots (with a notice) without matplotlib, distinct exit statuses."""

import json

import pytest
from test_bench import _bench, _write_jsonl

from specdec.bench import report
from specdec.bench.cli import MISMATCH_EXIT
from specdec.bench.harness import BenchResult, BenchSettings, Measurement
from specdec.bench.methods import MethodSpec
from specdec.bench.report import timing_warning, to_markdown
from specdec.bench.summary import summarize


def _measurement(question: str, method: str, seconds: float, call: int) -> Measurement:
    return Measurement(question_id=question, category="code", turn=0, seed=0, repeat=0, method=method,
                       batch_size=1, call=call, call_size=1, order=0, prompt_tokens=4, token_ids=[1] * 128,
                       seconds=seconds, metrics=None)


def test_per_prompt_medians_and_an_unreliable_reference_warns():
    # The run: one plain call took 8.2 s against 0.9 s for the other prompt; the totals make
    # ngram look 6x faster, the per-prompt speedups are 8.2x and 2.0x, and the spread of plain's tok/s says so.
    timings = {"plain": [8.2, 0.9], "ngram k=2": [1.0, 0.45]}
    measurements = [_measurement(q, method, s, call=10 * i + j)
                    for i, (method, seconds) in enumerate(timings.items())
                    for j, (q, s) in enumerate(zip("ab", seconds))]
    specs = [MethodSpec("plain"), MethodSpec("ngram", 2)]
    summary = summarize(measurements, specs, greedy=False)
    overall = {r.label: r for r in summary if r.category == "overall"}
    ngram, plain = overall["ngram k=2"], overall["plain"]
    assert ngram.speedup == pytest.approx(9.1 / 1.45)
    assert ngram.speedup_median == pytest.approx((8.2 + 2.0) / 2)
    assert (ngram.speedup_min, ngram.speedup_max) == (pytest.approx(2.0), pytest.approx(8.2))
    assert plain.tokens_per_second_spread == pytest.approx(8.2 / 0.9) and plain.speedup_median is None
    result = BenchResult(BenchSettings(max_tokens=128, temperature=1.0), [], measurements, summary)
    warning = timing_warning(result)
    assert warning.startswith("WARNING: timings are unreliable") and "9.1x at batch 1" in warning
    markdown = to_markdown(result)
    assert warning in markdown and "5.10x (2.00–8.20)" in markdown
    steady = summarize([_measurement(q, "plain", s, i) for i, (q, s) in enumerate(zip("ab", [1.0, 1.2]))],
                       specs[:1], greedy=False)
    assert timing_warning(BenchResult(BenchSettings(max_tokens=128), [], [], steady)) is None


@pytest.fixture
def bench_argv(text_model_dirs, tmp_path):
    data = _write_jsonl(tmp_path / "q.jsonl", [{"prompt": "def f(x):"}, {"prompt": "for i in"}])
    return ["--model", str(text_model_dirs["target"]), "--methods", "plain,ngram", "--k", "2", "--workload",
            "jsonl", "--data", str(data), "--max-tokens", "4", "--dtype", "float64", "--out", str(tmp_path / "out")]


def test_bench_without_matplotlib_writes_tables_and_says_so(bench_argv, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(report, "plotting_available", lambda: False)
    monkeypatch.setattr(report, "PLOTS", {name: None for name in report.PLOTS})  # would crash if called
    assert _bench(bench_argv) == 0
    err = capsys.readouterr().err
    assert "matplotlib is not installed" in err and "no plots" in err
    out = tmp_path / "out"
    assert (out / "bench.md").is_file() and json.loads((out / "bench.json").read_text())["mismatches"] == {}
    assert not list(out.glob("*.png"))


def test_a_real_greedy_mismatch_has_its_own_exit_status(bench_argv, capsys, monkeypatch):
    assert MISMATCH_EXIT not in (0, 1, 2)  # 1 is Python's status for a crash, 2 a bad input
    monkeypatch.setattr(report, "mismatch_warning", lambda result: "WARNING: greedy outputs differ")
    assert _bench(bench_argv) == MISMATCH_EXIT
    assert "WARNING: greedy outputs differ" in capsys.readouterr().err
