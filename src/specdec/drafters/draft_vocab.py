"""A drafter's reduced vocabulary: score only the most frequent tokens (EAGLE-3's draft vocabulary).

A drafter that turns features into logits with an output head (a draft model's own; the target's
for medusa, eagle, mtp and layer_skip's trained early exit) spends much of a draft position in that
head on a small model: a ``[V, H]`` product per drafted token. Scoring only ``V'`` rows of it, the
tokens seen most often in the corpus the drafter was trained on, cuts that cost by ``V / V'``; on the
embedded target the 1,024 most frequent of 8,192 tokens hold 99.9% of its greedy output on held-out
code.

Output stays exactly the target's. A draft is any token sequence with the distribution ``q`` it was
drawn from; :meth:`DraftVocab.full` gives the reduced logits back in the whole vocabulary with
``-inf`` outside ``V'``, so ``q`` is zero there (greedy drafts are the argmax over ``V'``), and
verification's residual ``max(p - q, 0)`` restores the target's probability of every token the
drafter cannot propose. A smaller ``V'`` only lowers acceptance.

A drafter's folder (a head folder, or a draft model's) records the counts in
``token_counts.safetensors``: ``counts`` ``[V]`` int64, how often each token occurs in the training
split (written by ``specdec train draft|medusa|eagle|mtp|early-exit``, or ``specdec train
token-counts`` for an older folder), and in its metadata the folder's default ``V'``
(``draft_vocab_size``, 0 for the whole vocabulary), which ``speculative_config["draft_vocab_size"]``
overrides.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from specdec.errors import SpecDecError
from specdec.models.cpu_linear import packed_copy
from specdec.tensor_files import save_tensors

TOKEN_COUNTS_FILE = "token_counts.safetensors"
DEFAULT_KEY = "draft_vocab_size"


def check_draft_vocab_size(size: object, name: str = "draft_vocab_size") -> None:
    """A draft vocabulary size given as ``name``: an integer >= 0 (0: the whole vocabulary), else a SpecDecError."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise SpecDecError(f"{name} must be an integer >= 0 (0: the whole vocabulary), got {size!r}")


def save_token_counts(folder: str | os.PathLike[str], tokens: np.ndarray, vocab_size: int, default_size: int = 0
                      ) -> None:
    """Write the counts of ``tokens`` (any shape of token ids below ``vocab_size``) into ``folder``, with
    ``default_size`` the folder's default draft vocabulary (0: the whole vocabulary)."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64).reshape(-1), minlength=vocab_size)[:vocab_size]
    Path(folder).mkdir(parents=True, exist_ok=True)
    save_tensors({"counts": torch.from_numpy(counts.astype(np.int64))}, Path(folder) / TOKEN_COUNTS_FILE,
                 metadata={DEFAULT_KEY: str(int(default_size))})


class DraftVocab:
    """The ``size`` most frequent tokens of a drafter's folder: ``ids`` ``[V']`` (most frequent first, ties
    by id), ``head`` ``[V', H]``, those rows of the output head, on the drafter's device, and ``scorer``, the
    weight the drafter's product reads: a packed copy of ``head`` on a CPU (:func:`~specdec.models.cpu_linear.
    packed_copy`; the same values within rounding, read 2-3x faster there), else ``head`` itself."""

    def __init__(self, ids: torch.Tensor, lm_head: torch.Tensor) -> None:
        self.ids = ids.to(lm_head.device)
        self.head = lm_head[self.ids].contiguous()
        packed = packed_copy(self.head)
        self.scorer = self.head if packed is None else packed
        self.vocab_size = int(lm_head.shape[0])

    @classmethod
    def load(cls, folder: Path | None, size: int | None, lm_head: torch.Tensor) -> DraftVocab | None:
        """The reduced vocabulary of ``size`` tokens (None: the folder's default) from ``folder``'s counts
        (``[V, H]`` ``lm_head``), or None for the whole vocabulary (``size`` 0 or at least ``V``, or no
        size and no counts)."""
        vocab = int(lm_head.shape[0])
        path = None if folder is None else Path(folder) / TOKEN_COUNTS_FILE
        if size == 0 or (size is None and (path is None or not path.is_file())):
            return None
        if path is None or not path.is_file():
            where = ("the draft is not a local folder" if folder is None
                     else f"{str(folder)!r} has no {TOKEN_COUNTS_FILE}")
            raise SpecDecError(f"a draft vocabulary needs token counts: {where} (`specdec train` writes them; "
                               "`specdec train token-counts` adds them to a folder)")
        try:
            with safe_open(str(path), framework="pt") as f:
                counts, default = f.get_tensor("counts"), (f.metadata() or {}).get(DEFAULT_KEY, "0")
            size = int(default) if size is None else size
        except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as exc:
            raise SpecDecError(f"cannot read the token counts in {str(path)!r}: {exc}") from exc
        if size <= 0 or size >= vocab:
            return None
        if counts.shape != (vocab,):
            raise SpecDecError(f"the token counts in {str(path)!r} cover {tuple(counts.shape)} tokens, not the "
                               f"{vocab} of the output head")
        order = torch.sort(-counts.to(torch.int64), stable=True).indices  # most frequent first, ties by id
        return cls(order[:size], lm_head)

    def full(self, logits: torch.Tensor) -> torch.Tensor:
        """Reduced logits ``[..., V']`` as logits over the whole vocabulary ``[..., V]``, ``-inf`` outside."""
        out = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.ids, logits)


def full_logits(vocab: DraftVocab | None, logits: torch.Tensor) -> torch.Tensor:
    """``logits`` scored with ``vocab``'s head rows as logits over the whole vocabulary (unchanged without one)."""
    return logits if vocab is None else vocab.full(logits)


def head_rows(vocab: DraftVocab | None) -> torch.Tensor | None:
    """``ForwardBatch.output_head`` for a forward that scores ``vocab`` (None: the whole head): its ``scorer``."""
    return None if vocab is None else vocab.scorer
