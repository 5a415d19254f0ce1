"""`specdec generate` says on one line which backend runs the target and why."""

import json

import pytest

from specdec.cli import main


@pytest.mark.parametrize("arch,backend,expected", [
    ("gpt2", "auto", "[specdec] backend: hf (transformers' forward, float64): the fast backend does not run it: "
                     "model type 'gpt2' is not one of"),
    ("llama", "hf", "[specdec] backend: hf (transformers' forward, float64): backend 'hf' was chosen"),
    ("llama", "auto", "[specdec] backend: fast (float64)"),
])
def test_generate_names_its_backend(model_dirs, tmp_path, capsys, arch, backend, expected):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [1, 2, 3]}) + "\n")
    code = main(["generate", "--prompts-file", str(prompts), "--model", str(model_dirs[arch]["target"]),
                 "--max-tokens", "2", "--dtype", "float64", "--backend", backend])
    err = capsys.readouterr().err.splitlines()
    assert code == 0
    lines = [line for line in err if line.startswith("[specdec] backend:")]
    assert len(lines) == 1 and lines[0].startswith(expected), err
