"""Model size presets for ``specdec train lm`` (targets) and ``specdec train draft`` (drafts).

A preset fixes the Llama shape and the default training context. Explicit command-line overrides
(``--layers``, ``--hidden-size``, ``--heads``, ``--intermediate-size``, ``--context``) win over it.
The vocabulary always comes from the tokenizer (a draft uses the target's vocabulary size).

Approximate parameter counts with an 8192-token vocabulary and tied embeddings: target ``base``
20.0M, ``small`` 5.5M; draft ``base`` 3.6M, ``small`` 1.4M. The ``base`` pair saved in bf16 takes
about 47 MB.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from specdec.errors import SpecDecError

if TYPE_CHECKING:
    from transformers import LlamaConfig

Role = Literal["lm", "draft"]


@dataclass(frozen=True)
class ModelPreset:
    """A Llama shape plus the default training context length (tokens per block)."""

    hidden_size: int
    layers: int
    heads: int
    intermediate_size: int
    context: int
    max_position_embeddings: int = 512


PRESETS: dict[Role, dict[str, ModelPreset]] = {
    "lm": {
        "tiny": ModelPreset(hidden_size=32, layers=2, heads=2, intermediate_size=64, context=64),
        "small": ModelPreset(hidden_size=256, layers=4, heads=4, intermediate_size=768, context=256),
        "base": ModelPreset(hidden_size=512, layers=6, heads=8, intermediate_size=1024, context=512),
    },
    "draft": {
        "tiny": ModelPreset(hidden_size=16, layers=1, heads=2, intermediate_size=32, context=64),
        "small": ModelPreset(hidden_size=128, layers=2, heads=2, intermediate_size=384, context=256),
        "base": ModelPreset(hidden_size=256, layers=2, heads=4, intermediate_size=640, context=512),
    },
}


def resolve_preset(
    role: Role,
    name: str,
    *,
    layers: int | None = None,
    hidden_size: int | None = None,
    heads: int | None = None,
    intermediate_size: int | None = None,
    context: int | None = None,
) -> ModelPreset:
    """The named preset with every non-``None`` override applied, validated."""
    if name not in PRESETS[role]:
        raise SpecDecError(f"unknown {role} preset {name!r}; choose one of {', '.join(PRESETS[role])}")
    overrides = {
        "layers": layers,
        "hidden_size": hidden_size,
        "heads": heads,
        "intermediate_size": intermediate_size,
        "context": context,
    }
    preset = replace(PRESETS[role][name], **{k: v for k, v in overrides.items() if v is not None})
    for field in overrides:
        actual = getattr(preset, field)
        if actual < 1:
            raise SpecDecError(f"{field.replace('_', '-')} must be at least 1, got {actual}")
    if preset.hidden_size % preset.heads:
        raise SpecDecError(f"hidden size {preset.hidden_size} is not divisible by {preset.heads} heads")
    if (preset.hidden_size // preset.heads) % 2:
        raise SpecDecError(
            f"head dim {preset.hidden_size // preset.heads} must be even for rotary embeddings"
        )
    if preset.context > preset.max_position_embeddings:
        preset = replace(preset, max_position_embeddings=preset.context)
    return preset


def llama_config(preset: ModelPreset, vocab_size: int, special_token_id: int) -> LlamaConfig:
    """A ``LlamaConfig`` for ``preset`` with tied embeddings; BOS/EOS/PAD are ``special_token_id``."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.layers,
        num_attention_heads=preset.heads,
        num_key_value_heads=preset.heads,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=special_token_id,
        eos_token_id=special_token_id,
        pad_token_id=special_token_id,
    )


def count_parameters(config: LlamaConfig) -> int:
    """Number of distinct parameters of a ``LlamaForCausalLM`` built from ``config`` (tied counted once)."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return sum(p.numel() for p in model.parameters())
