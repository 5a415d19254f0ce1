"""``specdec generate`` end to end on tiny models."""

import json
import subprocess
import sys

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
