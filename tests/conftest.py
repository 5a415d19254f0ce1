"""Tiny random models and a tiny tokenizer, built in memory and saved to temporary folders.

Models are float64 so that a different matmul shape (one token versus a whole draft) cannot
flip a near-tie between two logits: greedy equality is then exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import ARCHS, VOCAB, build_model, truncated_copy
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()
torch.set_num_threads(1)

@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """For each architecture: ``target``, ``same`` (identical copy), ``random`` (independent
    weights) and ``truncated`` (the target's first layer only) folders."""
    root = tmp_path_factory.mktemp("models")
    dirs: dict[str, dict[str, Path]] = {}
    for index, arch in enumerate(ARCHS):
        target = build_model(arch, seed=100 + index)
        variants = {
            "target": target,
            "same": target,
            "random": build_model(arch, seed=200 + index, layers=1),
            "truncated": truncated_copy(target, keep_layers=1),
        }
        dirs[arch] = {}
        for name, model in variants.items():
            path = root / arch / name
            model.save_pretrained(path)
            dirs[arch][name] = path
    return dirs


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer of ``VOCAB`` tokens, with ``<|endoftext|>`` as EOS."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = ["def f(x):\n    return x + 1\n", "for i in range(10):\n    print(i)\n"] * 20
    tokenizer.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    path = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def think_model_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    """A reasoning model's shape: the tiny tokenizer with ``<think>`` and ``</think>`` added as single tokens (as
    DeepSeek-R1's and Qwen3's), a Llama target over its vocabulary and its first layer as a draft (``draft``)."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens(["<think>", "</think>"])
    target = build_model("llama", seed=7, vocab=len(tokenizer))
    root = tmp_path_factory.mktemp("think_models")
    for name, model in (("target", target), ("draft", truncated_copy(target, keep_layers=1))):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return {"target": root / "target", "draft": root / "draft"}


@pytest.fixture(scope="session")
def text_model_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    """A Llama target and an identical draft whose folders hold the tokenizer too."""
    vocab = len(PreTrainedTokenizerFast.from_pretrained(tokenizer_dir))
    target = build_model("llama", seed=7, vocab=vocab)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    root = tmp_path_factory.mktemp("text_models")
    dirs = {}
    for name in ("target", "draft"):
        target.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        dirs[name] = root / name
    return dirs
