"""One flag vocabulary across ``generate``, ``serve``, ``bench`` and ``verify``: vLLM's names, the short
names as aliases of the same flags, ``--speculative-config`` and ``auto`` k everywhere; checks before loading."""

from __future__ import annotations

import json

import pytest

from specdec.cli import build_parser, main
from specdec.errors import SpecDecError

COMMANDS = ("generate", "serve", "bench", "verify")


def _parse(command: str, *flags: str):
    return build_parser().parse_args([command, *flags])


@pytest.mark.parametrize("command", COMMANDS)
def test_long_and_short_names_are_the_same_flag(command):
    long = _parse(command, "--speculative-model", "D", "--speculative-dtype", "float32",
                  "--num-speculative-tokens", "auto", "--speculative-config", "{}")
    short = _parse(command, "--draft-model", "D", "--draft-dtype", "float32", "--k", "auto")
    assert vars(long).keys() == vars(short).keys()
    for name in ("speculative_model", "draft_model"):
        if name in vars(long):
            assert getattr(long, name) == getattr(short, name) == "D"
    for name in ("speculative_dtype", "draft_dtype"):
        if name in vars(long):
            assert getattr(long, name) == getattr(short, name) == "float32"
    k = long.k if command == "bench" else long.num_speculative_tokens
    assert k in ("auto", ["auto"]) and long.speculative_config == "{}"


def test_verify_checks_the_dtype_generate_runs():
    assert _parse("verify").dtype == _parse("generate", "x").dtype == "auto"


def test_serve_takes_the_model_as_flag_or_positional():
    from specdec.server.cli import _model_flag

    for argv in (["M"], ["--model", "M"], ["M", "--model", "M"]):
        args = _parse("serve", *argv)
        _model_flag(args)
        assert args.model == "M"
    args = _parse("serve", "M", "--model", "N")
    with pytest.raises(SpecDecError, match="give the model once"):
        _model_flag(args)


def test_auto_method_gets_default_candidates():
    from specdec.drafters.base import SpeculativeConfig
    from specdec.generate_cli import AUTO_CANDIDATES, _speculative_config

    args = _parse("generate", "x", "--speculative-method", "auto", "--k", "3")
    config = _speculative_config(args, None, "auto")
    assert [c["method"] for c in config["candidates"]] == list(AUTO_CANDIDATES)
    with_draft = _speculative_config(args, "DRAFT", "auto")
    assert [c["method"] for c in with_draft["candidates"]] == ["draft_model", *AUTO_CANDIDATES]
    assert with_draft["candidates"][0]["model"] == "DRAFT"
    assert SpeculativeConfig.from_dict(with_draft).max_k == 3
    adaptive = _speculative_config(_parse("generate", "x", "--k", "auto"), None, "auto")
    assert adaptive["num_speculative_tokens"] == "auto"
    assert all(c["num_speculative_tokens"] == 8 for c in adaptive["candidates"])


@pytest.mark.parametrize("method", ["draft_model", "auto"])
def test_max_step_time_ratio_flag_reaches_the_config(method):
    from specdec.drafters.base import SpeculativeConfig
    from specdec.generate_cli import _speculative_config

    args = _parse("generate", "x", "--k", "auto", "--max-step-time-ratio", "1.1")
    config = _speculative_config(args, "DRAFT", method)
    assert config["max_step_time_ratio"] == 1.1
    assert SpeculativeConfig.from_dict(config).max_step_time_ratio == 1.1
    assert _speculative_config(_parse("generate", "x", "--k", "auto"), "DRAFT", method)["max_step_time_ratio"] is None


def test_auto_method_runs_from_the_flags(text_model_dirs, capsys):
    code = main(["generate", "def f(x):", "--model", str(text_model_dirs["target"]), "--speculative-method", "auto",
                 "--max-tokens", "4", "--dtype", "float64", "--json"])
    assert code == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["method"] == "auto"


@pytest.mark.parametrize("command", ["generate", "verify"])
def test_a_bad_speculative_config_fails_before_any_model_loads(tmp_path, capsys, command):
    missing = str(tmp_path / "no-such-model")  # loading it would fail with "does not exist"
    argv = [command, "--model", missing, "--speculative-config", '{"method": "auto"}']
    code = main([*argv, "x"] if command == "generate" else argv)
    err = capsys.readouterr().err
    assert code == 2 and "needs 'candidates'" in err and "does not exist" not in err, err


def test_generate_says_what_its_tokens_per_second_include(text_model_dirs, capsys):
    argv = ["generate", "def f(x):", "--model", str(text_model_dirs["target"]), "--max-tokens", "3",
            "--speculative-method", "ngram"]
    assert main(argv) == 0
    assert "after 1 untimed warm-up call" in capsys.readouterr().err
    assert main([*argv, "--warmup", "0"]) == 0
    assert "includes one-time warm-up costs" in capsys.readouterr().err


def test_bench_speculative_config_runs_under_its_method():
    from specdec.bench.cli import _speculative_config

    args = _parse("bench", "--speculative-config", '{"method": "suffix", "suffix_factor": 2}')
    configs: dict = {}
    assert _speculative_config(args, [], configs, given=False) == ["suffix"]
    assert configs == {"suffix": {"method": "suffix", "suffix_factor": 2}}
    assert _speculative_config(args, ["ngram"], {}, given=True) == ["ngram", "suffix"]
    with pytest.raises(SpecDecError, match="both configure"):
        _speculative_config(args, ["suffix"], {"suffix": {}}, given=True)
    with pytest.raises(SpecDecError, match="needs a 'method'"):
        _speculative_config(_parse("bench", "--speculative-config", "{}"), [], {}, given=False)


def test_a_line_before_the_slow_imports_on_a_terminal_only(capsys, monkeypatch):
    import sys

    from specdec.cli import announce

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    announce(["generate", "x"])
    assert capsys.readouterr().err == ""  # under a pipe a bad input stays one line
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    announce(["generate", "x", "--help"])
    announce(["--version"])
    assert capsys.readouterr().err == ""
    announce(["generate", "x"])
    assert "importing torch" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--prefill-share", "-1"], "prefill_share must be a number > 0"),
    (["--prefill-share", "1", "--no-enable-chunked-prefill"], "prefill_share paces chunked prefill's default"),
    (["--replicas", "2", "--prefill-share", "nan"], "prefill_share must be a number > 0"),
    # each replica reserving a GPU runs there under --device auto (this machine has none): nothing is paced
    (["--replicas", "2", "--num-gpus-per-replica", "1", "--prefill-share", "1"], "(the device is cuda): drop it"),
])
def test_serve_refuses_a_bad_prefill_share_before_loading(argv, message, capsys):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


@pytest.mark.parametrize("argv, message", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--tool-call-parser", "xml"], "invalid choice: 'xml'"),
    (["--reasoning-parser", "r2"], "invalid choice: 'r2'"),
])
def test_serve_refuses_auto_tool_choice_without_a_parser(argv, message, capsys):
    try:
        code = main(["serve", *argv])
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
