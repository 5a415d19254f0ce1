"""The embedded default pair: shipped in the package, small, and used by ``specdec generate`` with no flags."""

import json
from pathlib import Path

from transformers import AutoConfig

from specdec.assets import default_pair
from specdec.cli import main

PAIR = default_pair()


def test_pair_is_installed():
    assert PAIR is not None, "the embedded default pair is missing from src/specdec/assets/default_pair"


def test_pair_is_small_and_shares_a_vocabulary():
    target, draft = PAIR
    size = sum(f.stat().st_size for folder in PAIR for f in Path(folder).rglob("*") if f.is_file())
    assert size <= 50 * 2**20, f"the embedded pair takes {size / 2**20:.1f} MiB"
    target_config, draft_config = AutoConfig.from_pretrained(target), AutoConfig.from_pretrained(draft)
    assert target_config.vocab_size == draft_config.vocab_size
    assert (Path(target) / "tokenizer.json").is_file()
    assert (PAIR[0].parent / "MODEL_CARD.md").is_file()


def test_generate_with_no_model_flags_uses_the_pair(capsys):
    assert main(["generate", "def quicksort(arr):", "--max-tokens", "16", "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["model"] == str(PAIR[0]) and record["speculative_model"] == str(PAIR[1])
    assert record["method"] == "draft_model" and record["num_speculative_tokens"] == 4
    assert 1 <= len(record["token_ids"]) <= 16
    assert record["metrics"]["num_drafts"] >= 1
