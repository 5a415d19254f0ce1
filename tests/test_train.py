"""Smoke tests of ``specdec train``: corpus split, prompts, tokenizer, lm and draft training, bad input."""

from __future__ import annotations

import argparse
import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.errors import SpecDecError
from specdec.models.loader import load_hf_model, load_tokenizer
from specdec.train.cli import main as train_main
from specdec.train.cli import register
from specdec.train.corpus import code_prompts, list_files, split_files, token_stream
from specdec.train.draft import DistillSettings, greedy_acceptance, train_draft
from specdec.train.lm import check_eos, train_lm
from specdec.train.loop import TrainSettings
from specdec.train.presets import resolve_preset
from specdec.train.tokenizer import train_tokenizer

torch.set_num_threads(1)

MODULES = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]


def tiny_head_training(tmp_path, target) -> list[str]:
    """A corpus of :data:`MODULES` under ``tmp_path`` and the ``specdec train`` options that train a head on
    it in a few steps (tiny preset) against ``target``."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in MODULES:
        (corpus / f"{name}.py").write_text(_module_source(name))
    return ["--target", str(target), "--corpus", str(corpus), "--preset", "tiny",
            "--max-steps", "2", "--batch-size", "2", "--eval-blocks", "2", "--warmup-steps", "1",
            "--acceptance-prompts", "2", "--acceptance-tokens", "6", "--cache-dir", str(tmp_path / "cache")]


def _module_source(name: str) -> str:
    parts = [f'"""The {name} module."""\n\nimport os\n']
    for i in range(6):
        parts.append(
            f"\n\ndef {name}_add_{i}(left, right):\n"
            f'    """Return the sum of left and right plus {i}."""\n'
            f"    total = left + right\n"
            f"    if total > {i}:\n"
            f"        return total + {i}\n"
            f"    return total\n"
        )
    parts.append(
        f"\n\nclass {name.title()}Counter:\n"
        f'    """Count things for {name}."""\n\n'
        f"    def __init__(self):\n"
        f"        self.count = 0\n"
    )
    return "".join(parts)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for name in MODULES:
        (root / f"{name}.py").write_text(_module_source(name))
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text('"""A package."""\n')
    (root / "pkg" / "core.py").write_text(_module_source("core"))
    (root / "test").mkdir()
    (root / "test" / "test_alpha.py").write_text(_module_source("check_alpha"))
    (root / "notes.bin").write_bytes(b"\x00\x01")
    return root


@pytest.fixture(scope="session")
def tokenizer_dir(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=300, corpus_dirs=[corpus])


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _settings(out: Path, **kw: object) -> TrainSettings:
    base = {
        "batch_size": 4,
        "lr": 1e-2,
        "warmup_steps": 3,
        "eval_every": 10,
        "eval_blocks": 4,
        "log_every": 5,
    }
    base.update(kw)
    return TrainSettings(out_dir=out, **base)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def target_dir(
    corpus: Path, tokenizer_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    out = tmp_path_factory.mktemp("target")
    train_lm(tokenizer_dir, resolve_preset("lm", "tiny"), _settings(out, max_steps=30), [corpus], cache_dir)
    return out


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]


def test_split_is_deterministic_disjoint_and_by_module(corpus: Path) -> None:
    first, second = split_files([corpus]), split_files([corpus])
    assert first == second
    train = {f.path for f in first["train"]}
    held = {f.path for f in first["heldout"]}
    assert train and held and not train & held
    assert train | held == {f.path for f in list_files([corpus])}
    modules = {f.path.name: f.module for f in list_files([corpus])}
    assert modules["test_alpha.py"] == "alpha" and modules["core.py"] == "pkg"
    held_modules = {f.module for f in first["heldout"]}
    assert not held_modules & {f.module for f in first["train"]}
    assert "notes.bin" not in modules


def test_code_prompts_are_deterministic_signatures(corpus: Path) -> None:
    prompts = code_prompts(5, [corpus])
    assert prompts and prompts == code_prompts(5, [corpus])
    assert len(set(prompts)) == len(prompts)
    for p in prompts:
        assert p.startswith(("def ", "class ")) and p.endswith('"""\n')
        assert 40 <= len(p) <= 600
    train_prompts = code_prompts(100, [corpus], split="train", seed=3)
    assert not set(train_prompts) & set(code_prompts(100, [corpus]))
    assert 'def alpha_add_0(left, right):\n    """Return the sum of left and right plus 0."""\n' in (
        train_prompts + code_prompts(100, [corpus])
    )


def test_tokenizer_round_trips_code(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(tok) == 300 and tok.eos_token == "<|endoftext|>"
    for text in ["def f(x):\n\tif x:\n        return 'é→😀'  \r\n\n\n", "  x = [1 ,2]  # c\n", "\n\n    \n"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text


def test_token_stream_is_cached(corpus: Path, tokenizer_dir: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(tokenizer_dir, required=True)
    files = split_files([corpus])["train"]
    stream = token_stream(files, tok, tmp_path)
    assert stream.ndim == 1 and (stream == tok.eos_token_id).sum() == len(files)
    assert len(list(tmp_path.glob("tokens-*.npy"))) == 1
    assert (token_stream(files, tok, tmp_path) == stream).all()


def test_lm_trains_loads_and_loss_decreases(target_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log = _log(target_dir)
    assert log[-1]["step"] == 30 and log[-1]["loss"] < log[0]["loss"] - 0.5
    assert any(row["heldout_loss"] is not None for row in log)
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.bfloat16
    assert AutoTokenizer.from_pretrained(target_dir).decode([5, 6]) is not None
    summary = json.loads((target_dir / "train_summary.json").read_text())
    assert summary["steps"] == 30 and summary["stopped_by"] == "max_steps" and summary["command"]
    mask = os.umask(0)
    os.umask(mask)  # the weights get the umask's mode, as the folder's other files (safetensors alone writes 0600)
    assert stat.S_IMODE((target_dir / "model.safetensors").stat().st_mode) == 0o666 & ~mask


def test_resume_continues_from_saved_step(
    corpus: Path, tokenizer_dir: Path, cache_dir: Path, tmp_path: Path
) -> None:
    preset = resolve_preset("lm", "tiny")
    train_lm(tokenizer_dir, preset, _settings(tmp_path, max_steps=5), [corpus], cache_dir)
    summary = train_lm(
        tokenizer_dir, preset, _settings(tmp_path, max_steps=8, resume=True), [corpus], cache_dir
    )
    assert summary["steps"] == 8 and summary["tokens"] == 8 * 4 * preset.context
    assert [row["step"] for row in _log(tmp_path)] == [5, 8]


def test_time_budget_stops(corpus: Path, tokenizer_dir: Path, cache_dir: Path, tmp_path: Path) -> None:
    settings = _settings(tmp_path, time_budget=0.5, eval_every=1000)
    summary = train_lm(tokenizer_dir, resolve_preset("lm", "tiny"), settings, [corpus], cache_dir)
    assert summary["stopped_by"] == "time_budget" and summary["steps"] >= 1
    assert 0.5 <= summary["wall_time_s"] < 10


def test_draft_distills_and_reports_acceptance(
    corpus: Path, target_dir: Path, cache_dir: Path, tmp_path: Path
) -> None:
    distill = DistillSettings(
        generated_fraction=0.5, generated_sequences=4, acceptance_prompts=3, acceptance_tokens=8
    )
    summary = train_draft(
        target_dir,
        resolve_preset("draft", "tiny"),
        _settings(tmp_path, max_steps=6),
        distill,
        [corpus],
        None,
        cache_dir,
        draft_vocab_size=16,
    )
    assert 0.0 <= summary["acceptance_rate_greedy"] <= 1.0
    assert 1.0 <= summary["expected_chain_length_k4"] <= 5.0
    assert summary["parameters"] < summary["target_parameters"]
    draft, _ = load_hf_model(tmp_path, "auto", torch.device("cpu"))
    target, _ = load_hf_model(target_dir, "auto", torch.device("cpu"))
    assert draft.config.vocab_size == target.config.vocab_size
    from specdec.drafters.draft_vocab import DraftVocab

    vocab = DraftVocab.load(tmp_path, None, draft.get_output_embeddings().weight)  # the folder's default: 16
    assert vocab is not None and vocab.ids.numel() == 16


def test_draft_with_another_tokenizer_learns_from_target_text(
    corpus: Path, target_dir: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """A draft with its own tokenizer: the target's continuations re-encoded in its tokens, cross-entropy
    alone, its own vocabulary, no draft-vocabulary counts, and τ measured through the engine."""
    from specdec.train.draft import retokenize

    other_tok = train_tokenizer(tmp_path / "tok", vocab_size=280, corpus_dirs=[corpus])
    out = tmp_path / "draft"
    distill = DistillSettings(generated_fraction=0.5, generated_sequences=4, acceptance_prompts=2, acceptance_tokens=8)
    summary = train_draft(target_dir, resolve_preset("draft", "tiny"), _settings(out, max_steps=4), distill,
                          [corpus], other_tok, cache_dir)
    assert summary["own_tokenizer"] is True and summary["ce_weight"] == 1.0
    assert 1.0 <= summary["heldout_tau"] <= 5.0 and len(summary["heldout_acceptance_per_position"]) == 4
    draft, _ = load_hf_model(out, "auto", torch.device("cpu"))
    assert draft.config.vocab_size == len(load_tokenizer(other_tok, required=True))
    assert not (out / "token_counts.safetensors").exists()
    source, dest = load_tokenizer(target_dir, required=True), load_tokenizer(other_tok, required=True)
    rows = np.asarray([source.encode(text)[:6] for text in ("def alpha_add_1(left, right):", "    return total + 3")])
    stream = retokenize(rows, source, dest)
    texts = dest.decode(stream.tolist(), skip_special_tokens=False).split(dest.eos_token)
    assert texts == [source.decode(r) for r in rows.tolist()] + [""] and stream[-1] == dest.eos_token_id


def test_acceptance_of_target_against_itself_is_perfect(target_dir: Path) -> None:
    model, _ = load_hf_model(target_dir, torch.float32, torch.device("cpu"))
    result = greedy_acceptance(model, model, [[5, 6, 7], [8, 9]], new_tokens=6)
    assert result["acceptance_rate_greedy"] == 1.0 and result["expected_chain_length_k4"] == 5.0


def test_cli_registers_train_commands(corpus: Path, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["train", "lm", "--tokenizer", "t", "--out", "o", "--preset", "tiny", "--layers", "3"]
    )
    assert callable(args.func) and args.layers == 3 and args.corpus is None
    args = parser.parse_args(["train", "draft", "--target", "t", "--out", "o", "--corpus", "a", "b"])
    assert args.corpus == ["a", "b"] and args.ce_weight is None
    assert (
        train_main(["tokenizer", "--corpus", str(corpus), "--vocab-size", "270", "--out", str(tmp_path)]) == 0
    )
    assert train_main(["tokenizer", "--corpus", str(tmp_path / "missing"), "--out", str(tmp_path)]) == 2


def test_bad_corpus_inputs_raise(tmp_path: Path) -> None:
    with pytest.raises(SpecDecError, match="does not exist"):
        list_files([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "data.bin").write_bytes(b"x")
    with pytest.raises(SpecDecError, match="holds no text files"):
        list_files([tmp_path / "empty"])
    with pytest.raises(SpecDecError, match="empty corpus"):
        list_files([])
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "solo.py").write_text("x = 1\n")
    with pytest.raises(SpecDecError, match="needs at least two"):
        split_files([tmp_path / "one"])
    (tmp_path / "one" / "other.py").write_text("y = 2\n")
    with pytest.raises(SpecDecError, match="no top-level Python def/class"):
        code_prompts(3, [tmp_path / "one"])


def test_bad_training_inputs_raise(
    corpus: Path, tokenizer_dir: Path, target_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(SpecDecError, match="vocab size must be at least"):
        train_tokenizer(tmp_path / "t", vocab_size=100, corpus_dirs=[corpus])
    with pytest.raises(SpecDecError, match="tokenizer folder .* does not exist"):
        load_tokenizer(tmp_path / "nope", required=True)
    no_eos = load_tokenizer(tokenizer_dir, required=True)
    no_eos.eos_token = None
    with pytest.raises(SpecDecError, match="no EOS token"):
        check_eos(no_eos, tokenizer_dir)
    with pytest.raises(SpecDecError, match="--max-steps or --time-budget"):
        train_lm(tokenizer_dir, resolve_preset("lm", "tiny"), _settings(tmp_path), [corpus])
    with pytest.raises(SpecDecError, match="no checkpoint"):
        train_lm(
            tokenizer_dir,
            resolve_preset("lm", "tiny"),
            _settings(tmp_path, max_steps=2, resume=True),
            [corpus],
        )
    with pytest.raises(SpecDecError, match="unknown lm preset"):
        resolve_preset("lm", "huge")
    with pytest.raises(SpecDecError, match="not divisible"):
        resolve_preset("lm", "tiny", hidden_size=30, heads=4)
    distill = DistillSettings()
    with pytest.raises(SpecDecError, match="not fewer than the target"):
        big = resolve_preset("draft", "tiny", hidden_size=64, layers=4, intermediate_size=256)
        train_draft(target_dir, big, _settings(tmp_path, max_steps=2), distill, [corpus])
    other_tok = train_tokenizer(tmp_path / "other", vocab_size=280, corpus_dirs=[corpus])
    tiny, two_steps = resolve_preset("draft", "tiny"), _settings(tmp_path, max_steps=2)
    with pytest.raises(SpecDecError, match="--ce-weight 0.5 needs the target's vocabulary"):
        train_draft(target_dir, tiny, two_steps, DistillSettings(ce_weight=0.5), [corpus], other_tok)
    with pytest.raises(SpecDecError, match="--draft-vocab-size needs the target's vocabulary"):
        train_draft(target_dir, tiny, two_steps, distill, [corpus], other_tok, draft_vocab_size=16)
    bare = tmp_path / "bare_target"  # the target without its tokenizer: no text to convert through
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((target_dir / name).read_bytes())
    big_tok = train_tokenizer(tmp_path / "big", vocab_size=600, corpus_dirs=[corpus])
    with pytest.raises(SpecDecError, match="has no tokenizer of its own to convert text with"):
        train_draft(bare, tiny, two_steps, distill, [corpus], big_tok)
    with pytest.raises(SpecDecError, match="model folder .* does not exist"):
        train_draft(
            tmp_path / "nothing", resolve_preset("draft", "tiny"), _settings(tmp_path, max_steps=2), distill
        )


def test_long_stages_show_progress(corpus: Path, target_dir: Path, tmp_path: Path, capsys) -> None:
    """Tokenizer training, corpus tokenization and the draft's final acceptance check each report progress
    on stderr (they used to be silent for seconds to minutes)."""
    train_tokenizer(tmp_path / "tok", vocab_size=280, corpus_dirs=[corpus])
    assert "training a 280-token BPE on" in capsys.readouterr().err
    tok = load_tokenizer(tmp_path / "tok", required=True)
    token_stream(split_files([corpus])["train"], tok, tmp_path / "cache")
    assert "tokenizing corpus" in capsys.readouterr().err
    model, _ = load_hf_model(target_dir, torch.float32, torch.device("cpu"))
    greedy_acceptance(model, model, [[5, 6, 7], [8, 9]], new_tokens=3)
    err = capsys.readouterr().err
    assert "acceptance check" in err and "2/2" in err
