"""Backend for any Hugging Face ``AutoModelForCausalLM`` whose cache can be cropped.

The model's own modeling code runs unchanged: this wrapper only passes explicit
``position_ids``/``cache_position`` and a ``DynamicCache`` that it crops after rejections.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from specdec.errors import SpecDecError
from specdec.models.base import CachedLM


def context_window(config) -> int:
    """The model's context length from its config (``max_position_embeddings`` or equivalent)."""
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    raise SpecDecError(f"cannot tell the context length of model type {config.model_type!r} from its config")


class HFCachedLM(CachedLM):
    """Wraps a ``PreTrainedModel``; rollback is ``DynamicCache.crop``."""

    def __init__(self, model: PreTrainedModel, name: str) -> None:
        self.model = model.eval()
        self.config = model.config
        self.name = name
        self.device = model.device
        self.dtype = model.dtype
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_length = context_window(self.config)
        self._cache = self._new_cache()
        rigid = {type(layer).__name__ for layer in self._cache.layers if type(layer) is not DynamicLayer}
        if rigid:
            raise SpecDecError(
                f"model {name!r} ({self.config.model_type}) uses cache layers {sorted(rigid)} that cannot be "
                "rolled back to an arbitrary length (sliding-window or recurrent state); speculative decoding "
                "needs a cache that can be cropped"
            )

    def _new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    @property
    def length(self) -> int:
        return self._cache.get_seq_length()

    def reset(self) -> None:
        self._cache = self._new_cache()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, num_logits: int | None = None) -> torch.Tensor:
        start = self.length
        positions = torch.arange(start, start + input_ids.shape[1], device=self.device)
        out = self.model(
            input_ids=input_ids,
            position_ids=positions[None],
            cache_position=positions,
            past_key_values=self._cache,
            use_cache=True,
            logits_to_keep=1 if num_logits == 0 else (num_logits or 0),
        )
        if num_logits == 0:
            return out.logits[:, :0]
        return out.logits

    def crop(self, length: int) -> None:
        remove = self.length - length
        if remove < 0:
            raise ValueError(f"cannot crop a cache of {self.length} tokens to {length}")
        if remove:
            self._cache.crop(-remove)
