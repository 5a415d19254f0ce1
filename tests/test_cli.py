"""``specdec generate`` end to end on tiny models."""

import json
import os
import subprocess
import sys

import pytest

from specdec.cli import main


def test_json_output_fields(text_model_dirs, capsys):
    code = main(["generate", "def f(x):", "--model", str(text_model_dirs["target"]),
                 "--speculative-model", str(text_model_dirs["draft"]), "--num-speculative-tokens", "3",
                 "--max-tokens", "12", "--ignore-eos", "--dtype", "float64", "--json"])
    assert code == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["model"] == str(text_model_dirs["target"])
    assert record["speculative_model"] == str(text_model_dirs["draft"])
    assert record["method"] == "draft_model" and record["num_speculative_tokens"] == 3
    assert len(record["token_ids"]) == 12 and record["finish_reason"] == "length"
    metrics = record["metrics"]
    assert metrics["acceptance_rate"] == 1.0  # identical draft
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position",
                "mean_acceptance_length", "tokens_per_second", "time_drafting", "time_target", "time_other"):
        assert key in metrics


def test_penalty_flags_reach_the_sampling_parameters(text_model_dirs, capsys):
    """``--presence-penalty``, ``--frequency-penalty`` and ``--repetition-penalty``: the greedy output of the
    Python API with the same parameters (and not the unpenalized one)."""
    from specdec import LLM, SamplingParams

    argv = ["generate", "def f(x):", "--model", str(text_model_dirs["target"]), "--max-tokens", "12", "--ignore-eos",
            "--dtype", "float64", "--json", "--warmup", "0"]
    penalties = {"presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.4}
    assert main([*argv, *(f"--{k.replace('_', '-')}={v}" for k, v in penalties.items())]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    llm = LLM(text_model_dirs["target"], dtype="float64")
    expected, plain = (llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **p))
                       [0].outputs[0].token_ids for p in (penalties, {}))
    assert record["token_ids"] == expected != plain


def test_max_tokens_past_the_context_is_said_once(text_model_dirs, capsys):
    """The API generates what max_model_len leaves after the prompt (as vLLM's offline LLM does); the command says
    so before it runs, where it was silent."""
    code = main(["generate", "def f(x):", "--model", str(text_model_dirs["target"]), "--max-model-len", "24",
                 "--max-tokens", "100", "--ignore-eos", "--dtype", "float64", "--json"])
    assert code == 0
    captured = capsys.readouterr()
    record = json.loads(captured.out.strip().splitlines()[-1])
    fit = 24 - record["metrics"]["num_prompt_tokens"]
    assert len(record["token_ids"]) == fit and record["finish_reason"] == "length"
    assert f"--max-tokens 100: at most {fit} tokens fit after the prompt in --max-model-len 24" in captured.err


def test_plain_text_stream_and_summary(text_model_dirs, capsys):
    common = ["--model", str(text_model_dirs["target"]), "--max-tokens", "10", "--ignore-eos",
              "--dtype", "float64", "--speculative-method", "ngram"]
    assert main(["generate", "for i in", *common]) == 0
    plain = capsys.readouterr()
    assert main(["generate", "for i in", *common, "--stream"]) == 0
    streamed = capsys.readouterr()
    assert plain.out == streamed.out and plain.out.strip()
    assert "tokens/s" in plain.err and "acceptance rate" in plain.err


def test_prompts_file_gives_one_json_line_per_prompt(text_model_dirs, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def g():"}\n\n{"prompt_token_ids": [5, 6, 7]}\n')
    assert main(["generate", "--prompts-file", str(prompts), "--model", str(text_model_dirs["target"]),
                 "--max-tokens", "4", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    assert all(json.loads(line)["method"] == "none" for line in lines)


def test_console_script_runs_as_a_process(text_model_dirs):
    result = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "generate", "x", "--model", str(text_model_dirs["target"]),
         "--max-tokens", "3", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["token_ids"]) <= 3


def test_prompts_file_is_one_batched_generate_call(text_model_dirs, tmp_path, capsys, monkeypatch):
    from specdec.llm import LLM

    calls = []
    generate = LLM.generate

    def spy(self, prompts, params=None):
        calls.append((len(prompts), self.max_num_seqs, self.max_model_len))
        return generate(self, prompts, params)

    monkeypatch.setattr(LLM, "generate", spy)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def g():"}\n{"prompt": "for i in"}\n{"prompt_token_ids": [5, 6, 7]}\n')
    common = ["generate", "--prompts-file", str(prompts), "--model", str(text_model_dirs["target"]),
              "--max-tokens", "6", "--ignore-eos", "--dtype", "float64", "--speculative-method", "ngram", "--json"]
    assert main([*common, "--max-num-seqs", "2", "--max-model-len", "64"]) == 0
    batched = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert calls == [(1, 2, 64), (3, 2, 64)]  # the untimed warm-up of the first prompt, then one batch
    assert main([*common, "--max-num-seqs", "1"]) == 0
    queued = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["token_ids"] for r in batched] == [r["token_ids"] for r in queued]
    assert all(len(r["token_ids"]) == 6 for r in batched)


def test_method_choices_come_from_the_drafter_registry(text_model_dirs, capsys, monkeypatch):
    from specdec.drafters import DRAFTERS
    from specdec.drafters.ngram import NgramDrafter

    class LookupCopy(NgramDrafter):
        method = "lookup_copy"
        description = "prompt lookup under another name"

    monkeypatch.setitem(DRAFTERS, LookupCopy.method, LookupCopy)
    argv = ["generate", "def f(x):", "--model", str(text_model_dirs["target"]), "--max-tokens", "5",
            "--ignore-eos", "--dtype", "float64", "--json"]
    assert main([*argv, "--speculative-method", "lookup_copy", "--num-speculative-tokens", "2"]) == 0
    record = json.loads(capsys.readouterr().out.strip())
    assert record["method"] == "lookup_copy" and record["speculative_model"] is None
    assert record["num_speculative_tokens"] == 2
    with pytest.raises(SystemExit):
        main([*argv, "--speculative-method", "warp_drive"])
    assert "lookup_copy" in capsys.readouterr().err
    assert main([*argv, "--speculative-method", "draft_model"]) == 2  # needs --speculative-model
    assert main([*argv, "--max-model-len", "100000"]) == 2


def test_cli_starts_without_importing_torch():
    code = ("import sys; from specdec.cli import build_parser; build_parser().parse_args(['bench']); "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


# ---------------------------------------------------------------- issue 13: first run and bad values
def test_version(capsys):
    from specdec import __version__

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"specdec {__version__}"


def test_plain_mode_separates_the_prompts_of_a_file(text_model_dirs, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def g():"}\n{"prompt_token_ids": [5, 6, 7]}\n')
    common = ["generate", "--prompts-file", str(prompts), "--model", str(text_model_dirs["target"]),
              "--max-tokens", "4", "--dtype", "float64"]
    for extra in ([], ["--stream"]):
        assert main([*common, *extra]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert "--- prompt 1/2 ---" in lines and "--- prompt 2/2 ---" in lines
        assert lines.index("--- prompt 1/2 ---") < lines.index("--- prompt 2/2 ---")
    assert main(["generate", "x", *common[3:5], "--max-tokens", "2"]) == 0
    assert "--- prompt" not in capsys.readouterr().out  # one prompt: no separator


def test_json_says_which_dtype_ran(text_model_dirs, capsys):
    argv = ["generate", "x", "--model", str(text_model_dirs["target"]), "--max-tokens", "2", "--json"]
    assert main([*argv, "--dtype", "float64"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["dtype"] == "float64" and record["speculative_dtype"] is None
    assert main([*argv, "--dtype", "float32", "--speculative-model", str(text_model_dirs["draft"])]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["dtype"] == "float32" and record["speculative_dtype"] == "float32"


BAD_VALUES = [
    (["x", "--stream", "--json"], "--stream and --json do not combine"),
    (["x", "--seed", str(2**64)], "seed must be None or an integer in 0..2**64-1"),
    (["x", "--seed", "-3"], "seed must be None or an integer"),
    (["x", "--temperature", "nan"], "temperature must be a finite number"),
    (["x", "--temperature", "inf"], "temperature must be a finite number"),
    (["x", "--top-p", "nan"], "top_p must be in"),
    (["x", "--top-k", "-2"], "top_k must be an integer >= -1"),
    (["x", "--presence-penalty", "3"], "presence_penalty must be a number in [-2, 2], got 3.0"),
    (["x", "--repetition-penalty", "-1"], "repetition_penalty must be a finite number above 0"),
    (["x", "--max-tokens", "many"], "invalid int value"),
    (["x", "--stop", "\udcff"], "stop string is not valid UTF-8"),
    (["\udcff"], "prompt is not valid UTF-8 text"),
    (["x", "--speculative-method", "ngram", "--prompt-lookup-max", "10000000"], "prompt_lookup_max <= 32"),
    (["x", "--speculative-method", "ngram", "--speculative-model", "DRAFT"], "takes no --speculative-model"),
    (["x", "--max-num-seqs", "0"], "max_num_seqs must be"),
    (["x", "--dtype", "float8"], "unknown dtype"),
    (["x", "--device", "toaster"], "unknown device"),
    (["x", "--backend", "turbo"], "invalid choice"),
    (["x", "--no-such-flag"], "unrecognized arguments"),
]


@pytest.mark.parametrize("argv,message", BAD_VALUES)
def test_every_bad_value_exits_2_with_one_line(text_model_dirs, capsys, argv, message):
    argv = [a.replace("DRAFT", str(text_model_dirs["draft"])) for a in argv]
    try:
        code = main(["generate", *argv, "--model", str(text_model_dirs["target"]), "--max-tokens", "2"])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_bad_prompts_files_exit_2_with_one_line(text_model_dirs, tmp_path, capsys):
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text('{"prompt": "\\ud800"}\n')
    unreadable = tmp_path / "unreadable.jsonl"
    unreadable.write_text('{"prompt": "x"}\n')
    unreadable.chmod(0)
    cases = [
        (latin1, "latin1.jsonl:1: not UTF-8 text"),
        (surrogate, "prompt is not valid UTF-8 text"),
        (tmp_path, "is a directory, not a file"),
        (tmp_path / "missing.jsonl", "does not exist"),
    ]
    if os.geteuid() != 0:  # root reads anything
        cases.append((unreadable, "cannot be read"))
    for path, message in cases:
        code = main(["generate", "--prompts-file", str(path), "--model", str(text_model_dirs["target"]),
                     "--max-tokens", "2"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and message in err and len(err.splitlines()) == 1, (path, err)


def test_non_utf8_argument_from_a_real_process(text_model_dirs):
    result = subprocess.run(
        [sys.executable.encode(), b"-m", b"specdec.cli", b"generate", b"caf\xe9", b"--model",
         str(text_model_dirs["target"]).encode(), b"--max-tokens", b"2"],
        capture_output=True, timeout=120,
    )
    err = result.stderr.decode("utf-8", "replace").strip()
    assert result.returncode == 2 and "not valid UTF-8" in err and len(err.splitlines()) == 1, err
