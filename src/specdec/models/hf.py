"""Backend for any Hugging Face ``AutoModelForCausalLM`` whose cache can be cropped.

The model's own modeling code runs unchanged, one row of the batch at a time: each slot of
the pool is a ``DynamicCache``, rollback is ``DynamicCache.crop``. Architectures the fast
backend does not cover (GPT-2, Phi, Gemma, ...) take this path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from specdec.errors import SpecDecError
from specdec.models.base import CausalLM, ForwardBatch, ForwardOutput, KVCache


def context_window(config) -> int:
    """The model's context length from its config (``max_position_embeddings`` or equivalent)."""
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    raise SpecDecError(f"cannot tell the context length of model type {config.model_type!r} from its config")


@dataclass
class DynamicCachePool(KVCache):
    """One ``DynamicCache`` per slot; lengths mirror the caches' sequence lengths."""

    config: object = None
    caches: list[DynamicCache] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.caches = [DynamicCache(config=self.config) for _ in range(self.num_slots)]

    def set_length(self, slot: int, length: int) -> None:
        remove = self.lengths[slot] - length
        super().set_length(slot, length)
        if remove:
            self.caches[slot].crop(-remove)

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0
        self.caches[slot] = DynamicCache(config=self.config)


class HFCausalLM(CausalLM):
    """Wraps a ``PreTrainedModel``; runs a batch row by row through the model's own forward."""

    def __init__(self, model: PreTrainedModel, name: str) -> None:
        self.model = model.eval()
        self.config = model.config
        self.name = name
        self.device = model.device
        self.dtype = model.dtype
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_length = context_window(self.config)
        self.num_layers = getattr(self.config, "num_hidden_layers", 0)
        rigid = {type(layer).__name__ for layer in DynamicCache(config=self.config).layers}
        rigid.discard(DynamicLayer.__name__)
        if rigid:
            raise SpecDecError(
                f"model {name!r} ({self.config.model_type}) uses cache layers {sorted(rigid)} that cannot be "
                "rolled back to an arbitrary length (sliding-window or recurrent state); speculative decoding "
                "needs a cache that can be cropped"
            )

    def new_cache(self, num_slots: int, capacity: int) -> DynamicCachePool:
        return DynamicCachePool(num_slots, capacity, config=self.config)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: DynamicCachePool) -> ForwardOutput:
        if batch.tree_mask is not None:
            raise SpecDecError(f"{self.name}: tree attention masks need the fast backend (Llama, Qwen2, Mistral)")
        if batch.layers is not None or batch.input_hidden is not None or batch.exit_adapter is not None or \
                batch.output_head is not None:
            raise SpecDecError(f"{self.name}: a subset of layers or of the output head needs the fast backend "
                               "(Llama, Qwen2, Mistral)")
        self.check_fits(batch, cache)
        want_hidden = bool(batch.hidden_layers)
        wanted = batch.logits_rows
        keep = 1 if isinstance(wanted, torch.Tensor) and wanted.numel() == 0 else 0  # a prefill: skip most of the head
        logits, hidden = [], []
        for b, slot in enumerate(batch.slots):
            lo, hi = batch.cu_seqlens[b], batch.cu_seqlens[b + 1]
            start = cache.lengths[slot]
            out = self.model(
                input_ids=batch.input_ids[None, lo:hi],
                position_ids=batch.positions[None, lo:hi],
                cache_position=torch.arange(start, start + hi - lo, device=self.device),
                past_key_values=cache.caches[slot],
                use_cache=True,
                output_hidden_states=want_hidden,
                logits_to_keep=keep,
            )
            cache.lengths[slot] += hi - lo
            logits.append(out.logits[0])
            if want_hidden:
                hidden.append(torch.stack([out.hidden_states[i][0] for i in batch.hidden_layers], dim=1))
        all_logits = torch.cat(logits)
        out_hidden = torch.cat(hidden) if want_hidden else None
        if keep:
            return ForwardOutput(all_logits[:0], None)
        if wanted is not None:
            all_logits = all_logits[wanted]
            out_hidden = out_hidden[wanted] if out_hidden is not None else None
        return ForwardOutput(all_logits, out_hidden)
