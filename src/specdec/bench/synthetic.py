"""Random-weight Llama models of real shapes, for speed measurements without downloads.

Random weights agree with nothing, so they measure speed, never acceptance: plain decoding
against the memory-bandwidth limit, and (with the target as its own draft, all drafts
accepted) the engine's overhead. A model is built directly on its device in its dtype, with
transformers' weight initialisation switched off, then filled in place with ``N(0, 0.02)``
(norm weights 1): an 8B model takes seconds on a GPU, not minutes of CPU initialisation.
torch and transformers are imported when a model is built, so that the CLI can list the shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from specdec.bench.workloads import Question
from specdec.errors import SpecDecError
from specdec.shapes import SHAPES as SHAPES  # re-exported: the --synthetic choices
from specdec.shapes import get_shape

if TYPE_CHECKING:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM


SAME = "same"
"""``--draft-synthetic same``: the target is its own draft."""


def synthetic_config(shape: str, vocab_size: int | None = None, max_positions: int | None = None) -> LlamaConfig:
    """The ``LlamaConfig`` of a named shape (``vocab_size``/``max_positions`` override the shape's: a
    draft takes its target's)."""
    from transformers import LlamaConfig

    s = get_shape(shape)
    return LlamaConfig(
        vocab_size=vocab_size or s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        max_position_embeddings=max_positions or s.max_position_embeddings,
        rope_theta=s.rope_theta,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def build_synthetic(
    shape: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    vocab_size: int | None = None,
    max_positions: int | None = None,
) -> LlamaForCausalLM:
    """A random-weight ``LlamaForCausalLM`` of ``shape`` in ``dtype`` on ``device`` (eval mode), named
    ``synthetic-<shape>``; the same ``seed`` gives the same weights on the same device."""
    import torch
    from transformers import LlamaForCausalLM
    from transformers.initialization import no_init_weights

    config = synthetic_config(shape, vocab_size, max_positions)
    with torch.device(device), no_init_weights():
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    generator = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:  # RMSNorm weights
                param.fill_(1.0)
            else:
                param.normal_(0.0, config.initializer_range, generator=generator)
    model.config._name_or_path = f"synthetic-{shape}"
    return model.eval()


class RandomTokenPrompts:
    """Prompts of ``prompt_len`` random token ids in ``[0, vocab_size)``, one fixed draw per question
    turn (seeded by ``seed`` and the turn's text), for models without a tokenizer. Answers decode to
    nothing: synthetic questions have one turn."""

    def __init__(self, vocab_size: int, prompt_len: int, seed: int = 0) -> None:
        if prompt_len < 1:
            raise SpecDecError(f"--prompt-len must be at least 1, got {prompt_len}")
        self.vocab_size, self.prompt_len, self.seed = vocab_size, prompt_len, seed

    def build(self, turns: Sequence[str], answers: Sequence[str]) -> list[int]:
        import numpy as np

        key = [self.seed, *turns[-1].encode("utf-8")]
        rng = np.random.default_rng(key)
        return rng.integers(0, self.vocab_size, self.prompt_len).tolist()

    def decode(self, token_ids: Sequence[int]) -> str:
        return ""


def random_questions(num_prompts: int) -> list[Question]:
    """``num_prompts`` one-turn questions of category ``"random"`` for :class:`RandomTokenPrompts`."""
    if num_prompts < 1:
        raise SpecDecError(f"the number of prompts must be at least 1, got {num_prompts}")
    return [Question(f"random-{i}", "random", (f"random-{i}",), "random") for i in range(num_prompts)]
