"""Output paths and numeric flags are checked before any slow work: an unwritable ``--out``/``--json``/``DST``,
a non-empty training ``--out``, a non-finite learning rate, an unbounded ``verify --top-k`` or a bad ``bench``
value is exit status 2 with one line naming it, and a diverging training run stops instead of saving NaN weights.

No test here loads a model: the slow steps are replaced by functions that fail the test if they are reached.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import specdec.bench.cli
import specdec.bench.serving
import specdec.verify_cli
from specdec.cli import build_parser, main
from specdec.cli_checks import check_new_folder, check_output_file, check_output_folder, number
from specdec.errors import SpecDecError
from specdec.train.loop import CHECKPOINT_FILE, TrainSettings, checkpoint_dir, train


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """Exit status and stderr of ``specdec ARGV`` (argparse's errors included)."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err.strip()


def assert_one_line(code: int, err: str, *fragments: str) -> None:
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


@pytest.fixture
def no_slow_work(monkeypatch):
    """The model loads and runs of bench, bench-serve and verify fail the test if reached."""
    def reached(*args, **kwargs):
        raise AssertionError("a bad input reached the slow work")

    monkeypatch.setattr(specdec.bench.cli, "load_bench", reached)
    monkeypatch.setattr(specdec.bench.serving, "run_in_process", reached)
    monkeypatch.setattr(specdec.verify_cli, "_resolve_models", reached)


def unwritable_paths(tmp_path: Path) -> list[tuple[str, str]]:
    """(path, reason) pairs no command can write to: below a regular file, and in /proc where there is one."""
    (tmp_path / "file").write_text("x")
    paths = [(str(tmp_path / "file" / "out"), f"{str(tmp_path / 'file')!r} is not a folder")]
    if Path("/proc/self").is_dir():  # /proc takes no new entries, even from root
        paths.append(("/proc/nope", "No such file or directory"))
    return paths


OUTPUT_COMMANDS = [
    ["train", "tokenizer", "--corpus", "CORPUS", "--out", "OUT"],
    ["train", "lm", "--tokenizer", "missing-tokenizer", "--out", "OUT", "--max-steps", "1"],
    ["train", "draft", "--target", "missing-target", "--out", "OUT", "--max-steps", "1"],
    ["train", "eagle", "--target", "missing-target", "--out", "OUT", "--max-steps", "1"],
    ["train", "token-counts", "--target", "missing-target", "--out", "OUT"],
    ["inflate", "missing-source", "OUT", "--shape", "tiny"],
    ["bench", "--out", "OUT"],
    ["bench-serve", "--base-url", "http://127.0.0.1:9/v1", "--json", "OUT/x.json"],
    ["bench-serve", "--in-process", "--json", "OUT/x.json"],
]


@pytest.mark.parametrize("argv", OUTPUT_COMMANDS, ids=lambda argv: " ".join(argv[:2]))
def test_unwritable_outputs_are_one_line_before_any_work(argv, tmp_path, capsys, no_slow_work):
    flag = "DST" if argv[0] == "inflate" else "--json" if "--json" in argv else "--out"
    for path, reason in unwritable_paths(tmp_path):
        args = [a.replace("OUT", path).replace("CORPUS", str(tmp_path)) for a in argv]
        shown = path + "/x.json" if flag == "--json" else path
        code, err = run_cli(args, capsys)
        assert_one_line(code, err, f"cannot write {flag} {shown!r}: {reason}")


def test_the_probe_leaves_nothing_behind(tmp_path):
    check_output_folder(tmp_path / "a" / "b", "--out")
    check_output_file(tmp_path / "c" / "d.json", "--json")
    assert list(tmp_path.iterdir()) == []
    existing = tmp_path / "results.json"
    existing.write_text("kept")
    check_output_file(existing, "--json")
    assert existing.read_text() == "kept"  # appended to nothing, not truncated
    with pytest.raises(SpecDecError, match="cannot write --json .*: is a folder"):
        check_output_file(tmp_path, "--json")
    with pytest.raises(SpecDecError, match="cannot write --out .*: exists and is not a folder"):
        check_output_folder(existing, "--out")


@pytest.mark.parametrize("what", ["tokenizer", "lm", "draft", "medusa"])
def test_training_refuses_a_non_empty_out_as_inflate_does(what, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")
    source = {"tokenizer": [], "lm": ["--tokenizer", str(tmp_path / "tok")]}.get(
        what, ["--target", str(tmp_path / "target")])
    steps = [] if what == "tokenizer" else ["--max-steps", "1"]
    code, err = run_cli(["train", what, *source, "--out", str(out), *steps], capsys)
    hint = "" if what == "tokenizer" else " (--resume continues the run saved there)"
    assert_one_line(code, err, f"--out {str(out)!r} exists and is not an empty folder{hint}")
    code, err = run_cli(["inflate", "missing-source", str(out), "--shape", "tiny"], capsys)
    assert_one_line(code, err, f"DST {str(out)!r} exists and is not an empty folder")
    if what != "tokenizer":  # --resume continues in that folder: the next problem is the missing input
        code, err = run_cli(["train", what, *source, "--out", str(out), *steps, "--resume"], capsys)
        assert_one_line(code, err)
        assert "not an empty folder" not in err and "does not exist" in err
    (out / "config.json").unlink()  # an empty folder is a new one
    assert check_new_folder(out, "--out") is None


BAD_TRAIN_FLOATS = [
    ("lm", "--lr", "nan", "> 0"), ("lm", "--lr", "inf", "> 0"), ("lm", "--lr", "0", "> 0"),
    ("lm", "--lr", "-1e-3", "> 0"), ("lm", "--weight-decay", "-1", ">= 0"), ("lm", "--weight-decay", "nan", ">= 0"),
    ("lm", "--time-budget", "inf", "> 0"), ("draft", "--lr", "inf", "> 0"), ("draft", "--ce-weight", "2", "in 0..1"),
    ("draft", "--generated-fraction", "nan", "in 0..1"), ("draft", "--generated-temperature", "inf", ">= 0"),
    ("eagle", "--feature-weight", "inf", ">= 0"), ("mtp", "--weight-decay", "-0.5", ">= 0"),
]


@pytest.mark.parametrize("what,flag,value,bound", BAD_TRAIN_FLOATS)
def test_training_floats_are_checked_at_parse_time(what, flag, value, bound, tmp_path, capsys):
    source = ["--tokenizer", "tok"] if what == "lm" else ["--target", "target"]
    code, err = run_cli(["train", what, *source, "--out", str(tmp_path / "o"), f"{flag}={value}"], capsys)
    assert_one_line(code, err, f"argument {flag}: must be a finite number {bound}, got {value}")
    assert not (tmp_path / "o").exists()


def test_train_settings_refuse_non_finite_values(tmp_path):
    for fields, message in (({"lr": math.inf}, "--lr must be a finite positive"),
                            ({"lr": math.nan}, "--lr must be a finite positive"),
                            ({"weight_decay": -1.0}, "--weight-decay must be a finite non-negative"),
                            ({"time_budget": math.nan}, "--time-budget must be a finite positive")):
        with pytest.raises(SpecDecError, match=message):
            TrainSettings(out_dir=tmp_path, max_steps=1, **fields).validate()


def _tiny_run(tmp_path: Path, loss_fn, lr: float = 1e-2, save_every: int = 1):
    """``train`` on a 4x4 linear layer (a stand-in with a ``config``) for 4 steps, a checkpoint after each;
    returns the final saves made."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    model.config = SimpleNamespace(save_pretrained=lambda folder: None)
    saved = []
    settings = TrainSettings(out_dir=tmp_path, batch_size=2, lr=lr, warmup_steps=0, max_steps=4, eval_every=100,
                             eval_blocks=2, save_every=save_every, log_every=1)
    data = np.ones((2, 4), dtype=np.int64)
    train(model, None, lambda i: data, data, loss_fn, settings, save_fn=lambda *args: saved.append(args))
    return saved


def test_training_stops_when_the_loss_is_nan(tmp_path):
    calls = []

    def loss_fn(model, ids):  # finite for the first step, NaN from the second
        calls.append(ids)
        loss = model(ids.float()).pow(2).mean()
        return loss if len(calls) < 2 else loss * math.nan

    with pytest.raises(SpecDecError, match="training diverged at step 2: the training loss is nan"):
        _tiny_run(tmp_path, loss_fn)
    state = torch.load(checkpoint_dir(tmp_path) / CHECKPOINT_FILE, weights_only=False)
    assert state["step"] == 1, "the NaN step was not saved"
    assert all(torch.isfinite(t).all() for t in state["model"].values())


def test_training_stops_when_a_huge_learning_rate_diverges(tmp_path):
    with pytest.raises(SpecDecError, match="training diverged at step 2: the training loss is (inf|nan)"):
        _tiny_run(tmp_path, lambda model, ids: model(ids.float()).pow(2).mean(), lr=1e30)
    state = torch.load(checkpoint_dir(tmp_path) / CHECKPOINT_FILE, weights_only=False)
    assert state["step"] == 1 and not (tmp_path / "train_summary.json").exists()


BAD_VERIFY = [
    (["--top-k", "100000"], "--top-k must be at most 64"),
    (["--top-k", "65"], "--top-k must be at most 64"),
    (["--seed", "-1"], "--seed must be an integer in 0..2**32-1, got -1"),
    (["--seed", str(2**32)], f"got {2**32}"),
    (["--temperature", "0"], "--temperature 0 is greedy: the sampling test would have a single outcome"),
    (["--temperature", "nan"], "--temperature must be a finite number above 0"),
    (["--temperature", "-1"], "--temperature must be a finite number above 0"),
    (["--num-prompts", "1", "--sampling-prompts", "5"], "--sampling-prompts 5 is more than --num-prompts 1"),
    (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization: verify runs two LLMs side by side"),
    (["--gpu-memory-utilization", "1.5"], "argument --gpu-memory-utilization: must be a finite number > 0 and <= 1"),
]


@pytest.mark.parametrize("extra,message", BAD_VERIFY)
def test_verify_checks_its_sampling_flags_before_loading(extra, message, capsys, no_slow_work):
    code, err = run_cli(["verify", *extra], capsys)
    assert_one_line(code, err, message)
    assert "1000003" not in err


def test_verify_accepts_the_bounds():
    parse = build_parser().parse_args
    specdec.verify_cli._check_flags(parse(["verify", "--top-k", "64", "--seed", str(2**32 - 1)]))
    specdec.verify_cli._check_flags(parse(["verify", "--temperature", "0", "--sampling-prompts", "0"]))


BAD_BENCH = [
    (["--seeds", "-1"], "--seeds must be integers in 0..2**64-1, got -1"),
    (["--seeds", "0", str(2**64)], f"got {2**64}"),
    (["--kv-cache-memory", "-1"], "kv_cache_memory must be a positive size"),
    (["--prompt-len", "-1"], "--prompt-len must be at least 1, got -1"),
    (["--synthetic", "tiny", "--prompt-len", "0"], "--prompt-len must be at least 1, got 0"),
    (["--prompts-per-category", "0"], "--prompts-per-category must be at least 1, got 0"),
    (["--workload", "code", "--num-prompts", "0"], "--prompts-per-category must be at least 1, got 0"),
    (["--bandwidth-gbs", "-1"], "argument --bandwidth-gbs: must be a finite number > 0, got -1"),
    (["--bandwidth-gbs", "nan"], "argument --bandwidth-gbs: must be a finite number > 0, got nan"),
    (["--temperature", "inf"], "argument --temperature: must be a finite number >= 0, got inf"),
]


@pytest.mark.parametrize("extra,message", BAD_BENCH)
def test_bench_checks_its_values_before_loading(extra, message, tmp_path, capsys, no_slow_work):
    out = tmp_path / "results"
    code, err = run_cli(["bench", *extra, "--out", str(out)], capsys)
    assert_one_line(code, err, message)
    assert not out.exists()


def test_number_type_messages():
    positive = number(float, 0, above=True)
    assert positive("1e-3") == 1e-3
    for text in ("0", "nan", "inf", "-inf"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"must be a finite number > 0, got {text}"):
            positive(text)
    with pytest.raises(argparse.ArgumentTypeError, match="invalid float value: 'fast'"):
        positive("fast")
    assert number(int, 1)("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="must be in 1..8, got 9"):
        number(int, 1, 8)("9")
