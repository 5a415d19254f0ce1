"""``specdec train lm``: pretrain a ``transformers.LlamaForCausalLM`` target on a code corpus.

The model is transformers' own Llama class built from a size preset (see
:mod:`specdec.train.presets`); the loss is next-token cross-entropy on fixed-length blocks of the
corpus's train split, the held-out loss is measured on the held-out modules.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from specdec.errors import SpecDecError
from specdec.models.loader import load_tokenizer, resolve_device
from specdec.train.corpus import TokenBlocks, split_files, token_stream
from specdec.train.loop import TrainSettings, checkpoint_config, train
from specdec.train.presets import ModelPreset, count_parameters, llama_config

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def check_eos(tokenizer: PreTrainedTokenizerBase, folder: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """``tokenizer``, after checking that it has the EOS token training separates documents with."""
    if tokenizer.eos_token_id is None:
        raise SpecDecError(f"tokenizer in {str(folder)!r} has no EOS token")
    return tokenizer


def causal_lm_loss(model: PreTrainedModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``model`` on ``input_ids`` ``(batch, block)``; a scalar."""
    return model(input_ids=input_ids, labels=input_ids).loss


def corpus_blocks(
    corpus_dirs: Sequence[str | os.PathLike[str]] | None,
    tokenizer: PreTrainedTokenizerBase,
    context: int,
    seed: int,
    cache_dir: str | os.PathLike[str] | None,
) -> tuple[TokenBlocks, TokenBlocks]:
    """Train and held-out token blocks of ``context`` tokens: ``(train, heldout)``."""
    parts = split_files(corpus_dirs)
    train_blocks = TokenBlocks(token_stream(parts["train"], tokenizer, cache_dir), context, seed)
    heldout_blocks = TokenBlocks(token_stream(parts["heldout"], tokenizer, cache_dir), context, seed)
    return train_blocks, heldout_blocks


def train_lm(
    tokenizer_dir: str | os.PathLike[str],
    preset: ModelPreset,
    settings: TrainSettings,
    corpus_dirs: Sequence[str | os.PathLike[str]] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Pretrain a Llama target with the shape of ``preset`` and return the training summary.

    With ``settings.resume`` the model config is the one saved in the checkpoint (the preset is
    ignored) and training continues from the saved step.
    """
    import torch
    from transformers import LlamaForCausalLM

    settings.validate()
    tokenizer = check_eos(load_tokenizer(tokenizer_dir, required=True), tokenizer_dir)
    if settings.resume:
        config = checkpoint_config(settings.out_dir)
    else:
        config = llama_config(preset, len(tokenizer), tokenizer.eos_token_id)
    if config.vocab_size < len(tokenizer):
        raise SpecDecError(
            f"checkpoint vocab size {config.vocab_size} is smaller than the tokenizer's {len(tokenizer)}"
        )
    context = min(preset.context, config.max_position_embeddings)
    train_blocks, heldout_blocks = corpus_blocks(corpus_dirs, tokenizer, context, settings.seed, cache_dir)
    torch.manual_seed(settings.seed)
    model = LlamaForCausalLM(config).to(resolve_device("auto"))
    print(
        f"target: {count_parameters(config) / 1e6:.2f}M parameters, {len(train_blocks)} train blocks and "
        f"{len(heldout_blocks)} held-out blocks of {context} tokens",
        flush=True,
    )
    return train(
        model,
        tokenizer,
        lambda i: train_blocks.batch(i, settings.batch_size),
        heldout_blocks.first(settings.eval_blocks),
        causal_lm_loss,
        settings,
        extra_summary={"role": "lm", "context": context},
    )
