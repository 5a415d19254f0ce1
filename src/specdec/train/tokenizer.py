"""Byte-level BPE tokenizers trained on a corpus, saved so that ``AutoTokenizer`` loads them.

The tokenizer splits text with the GPT-2 style byte-level pre-tokenizer (no prefix space), so every
byte sequence is representable and ``decode(encode(text)) == text`` holds exactly, indentation and
newlines included. ``<|endoftext|>`` is the only special token; it serves as BOS, EOS, PAD and UNK
and is not added by ``encode`` (pass it explicitly where a document boundary is wanted).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from specdec.errors import SpecDecError
from specdec.train.corpus import iter_texts, split_files

EOS_TOKEN = "<|endoftext|>"
MIN_VOCAB_SIZE = 257
"""256 byte symbols plus the special token."""


def train_tokenizer(
    out_dir: str | os.PathLike[str],
    vocab_size: int = 8192,
    corpus_dirs: Sequence[str | os.PathLike[str]] | None = None,
    min_frequency: int = 2,
) -> Path:
    """Train a byte-level BPE tokenizer on the train split of the corpus and save it to ``out_dir``.

    The held-out modules are not seen, so held-out measurements are not flattered. Returns the
    output folder, which ``transformers.AutoTokenizer.from_pretrained`` loads.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB_SIZE:
        raise SpecDecError(
            f"vocab size must be at least {MIN_VOCAB_SIZE} (256 bytes + 1 special), got {vocab_size}"
        )
    print("reading the corpus", file=sys.stderr, flush=True)
    texts = iter_texts(split_files(corpus_dirs)["train"])
    if not texts:
        raise SpecDecError("empty corpus: the train split holds no UTF-8 text")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    print(f"training a {vocab_size}-token BPE on {len(texts)} files", file=sys.stderr, flush=True)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return out
