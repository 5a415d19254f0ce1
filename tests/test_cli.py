"""``specdec generate`` end to end on tiny models."""

import json
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
    assert calls == [(3, 2, 64)]
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
