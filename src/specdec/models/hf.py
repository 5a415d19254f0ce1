"""Backend for any Hugging Face ``AutoModelForCausalLM``: the model's own forward, one row at a time.

Each slot of the pool is a transformers ``DynamicCache`` passed to the model's forward. Rolling a
slot back takes one of two ways, chosen once from the cache's layer types:

- **crop**: every layer keeps all its entries (``DynamicLayer``), so rollback is
  ``DynamicCache.crop``. Sliding-window layers (Mistral, Gemma 2/3, ...) are built as full layers
  too: transformers' mask functions take the window from the config (``config.sliding_window``),
  not from the cache layer, so attention still sees only the window, and a window crossed by the
  generation stays exact. The cost is memory and attention over the whole slot, not the window.
- **replay**: a recurrent or hybrid state (Mamba, Jamba, linear attention) cannot be cut back to
  an earlier token. The pool remembers the tokens each slot was fed; a rollback drops the state,
  and the slot's next forward feeds the committed tokens again before its new ones. Exact, but a
  rejected draft costs a forward over the whole sequence.

Architectures the fast backend does not cover (GPT-2, Phi, Gemma, OPT, Falcon, ...) take this path.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers import __version__ as transformers_version
from transformers import cache_utils as hf_cache

from specdec.errors import SpecDecError
from specdec.models.base import CausalLM, ForwardBatch, ForwardOutput, KVCache
from specdec.models.families import FAST_BACKEND

CACHE_ARGUMENTS = ("cache", "past_key_values")
"""Names of the forward's cache argument, current first: transformers renamed ``past_key_values``
to ``cache`` during 5.x (the old name warns that it will be removed in 5.40)."""

_CROPPABLE_LAYERS = tuple(getattr(hf_cache, name) for name in ("DynamicLayer", "DummyLayer") if hasattr(hf_cache, name))
"""Cache layer types whose ``crop`` restores an earlier state exactly (``DummyLayer`` holds nothing:
a layer that reads another layer's entries)."""


STATE_SPACE_CONTEXT = 1 << 20
"""The context length given to a model whose config names none and whose cache is all recurrent
state (Mamba): it has no position table, so only ``max_model_len`` bounds its sequences."""


def position_limit(config) -> int | None:
    """The model's context length from its config (``max_position_embeddings`` or equivalent), or None."""
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def context_window(config) -> int:
    """The model's context length from its config; a :class:`SpecDecError` when it names none."""
    limit = position_limit(config)
    if limit is None:
        raise SpecDecError(f"cannot tell the context length of model type {config.model_type!r} from its config")
    return limit


def new_slot_cache(config) -> DynamicCache:
    """The cache of one slot: transformers' own layer types for ``config``, with every plain
    sliding-window layer replaced by a full one (the mask, built from the config, keeps the window)."""
    cache = DynamicCache(config=config)
    for index, layer in enumerate(cache.layers):
        if type(layer) is hf_cache.DynamicSlidingWindowLayer:
            cache.layers[index] = hf_cache.DynamicLayer()
    return cache


def _attends(layer) -> bool:
    """Whether a cache layer holds attention keys (a recurrent-only layer holds a state only)."""
    return isinstance(layer, hf_cache.CacheLayerMixin)


def needs_replay(config) -> bool:
    """Whether a slot's cache for ``config`` holds a state ``crop`` cannot roll back (recurrent layers)."""
    return not all(isinstance(layer, _CROPPABLE_LAYERS) and not getattr(layer, "is_sliding", False)
                   for layer in new_slot_cache(config).layers)


@dataclass
class DynamicCachePool(KVCache):
    """One ``DynamicCache`` per slot; ``lengths`` are the committed tokens each slot holds.

    ``replay``: the caches cannot be cropped; ``fed[s]`` are the tokens slot ``s``'s cache has seen
    (``[n]`` device tensors, in order) and ``replay_ids[s]`` the tokens its next forward feeds first
    after a rollback dropped its state (None when its cache is current).
    """

    config: object = None
    replay: bool = False
    caches: list[DynamicCache] = field(init=False)
    fed: list[list[torch.Tensor]] = field(init=False)
    replay_ids: list[torch.Tensor | None] = field(init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.caches = [new_slot_cache(self.config) for _ in range(self.num_slots)]
        self.fed = [[] for _ in range(self.num_slots)]
        self.replay_ids = [None] * self.num_slots

    def set_length(self, slot: int, length: int) -> None:
        remove = self.lengths[slot] - length
        super().set_length(slot, length)
        if not remove:
            return
        if not self.replay:
            self.caches[slot].crop(-remove)
            return
        kept = self.committed(slot)
        self.caches[slot] = new_slot_cache(self.config)
        self.fed[slot] = []
        self.replay_ids[slot] = kept if length else None

    def committed(self, slot: int) -> torch.Tensor:
        """The tokens slot ``slot`` holds, ``[lengths[slot]]`` (replay pools only)."""
        pending = self.replay_ids[slot]
        parts = ([pending] if pending is not None else []) + self.fed[slot]
        return torch.cat(parts)[: self.lengths[slot]]

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0
        self.caches[slot] = new_slot_cache(self.config)
        self.fed[slot] = []
        self.replay_ids[slot] = None


def own_cache_classes(model: PreTrainedModel) -> list[str]:
    """Cache classes that ``model``'s modeling module defines for itself (Mamba's ``MambaCache`` and
    the hybrid models' caches before transformers moved their states into cache layers): a model that
    keeps its state there ignores or rejects the ``DynamicCache`` this backend passes."""
    module = sys.modules.get(type(model).__module__)
    if module is None:
        return []
    return sorted(name for name, value in vars(module).items()
                  if isinstance(value, type) and name.endswith("Cache") and value.__module__ == module.__name__)


class HFCausalLM(CausalLM):
    """Wraps a ``PreTrainedModel``; runs a batch row by row through the model's own forward."""

    def __init__(self, model: PreTrainedModel, name: str, backend_reason: str | None = None) -> None:
        self.model = model.eval()
        self.backend_reason = backend_reason
        self.config = model.config
        self.name = name
        self.device = model.device
        self.dtype = model.dtype
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.num_layers = getattr(self.config, "num_hidden_layers", 0)
        about = f"model {name!r} ({self.config.model_type})"
        own = own_cache_classes(model)
        if own:
            raise SpecDecError(f"{about} keeps its state in its own cache class {own[0]!r} in transformers "
                               f"{transformers_version}, which the fallback backend cannot roll back")
        parameters = inspect.signature(model.forward).parameters
        names = [n for n in CACHE_ARGUMENTS if n in parameters]
        if not names:
            raise SpecDecError(f"{about} takes no cache argument ({' or '.join(CACHE_ARGUMENTS)}) in transformers "
                               f"{transformers_version}; the fallback backend cannot keep its state between forwards")
        self._cache_argument = names[0]
        self._takes_positions = "position_ids" in parameters
        self._takes_logits_to_keep = "logits_to_keep" in parameters
        attends = any(_attends(layer) for layer in new_slot_cache(self.config).layers)
        # a key mask as generate passes it (older models size their causal mask from it); a state-space
        # model reads it as a mask over the tokens fed, so it gets none
        self._takes_attention_mask = "attention_mask" in parameters and attends
        self.replay = needs_replay(self.config)
        limit = position_limit(self.config)
        if limit is None and self.replay and not attends:
            limit = STATE_SPACE_CONTEXT
        self.max_length = limit if limit is not None else context_window(self.config)

    def new_cache(self, num_slots: int, capacity: int, num_blocks: int | None = None,
                  prefix_caching: bool = False) -> DynamicCachePool:
        # transformers' caches grow per sequence: no blocks to budget, no prefix to share.
        return DynamicCachePool(num_slots, capacity, config=self.config, replay=self.replay)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: DynamicCachePool) -> ForwardOutput:
        if batch.tree_mask is not None:
            raise SpecDecError(f"{self.name}: tree attention masks need {FAST_BACKEND}")
        if batch.layers is not None or batch.input_hidden is not None or batch.exit_adapter is not None or \
                batch.output_head is not None:
            raise SpecDecError(f"{self.name}: a subset of layers or of the output head needs {FAST_BACKEND}")
        self.check_fits(batch, cache)
        want_hidden = bool(batch.hidden_layers)
        wanted = batch.logits_rows
        prefill = isinstance(wanted, torch.Tensor) and wanted.numel() == 0  # no logits: skip most of the head
        logits, hidden = [], []
        for b, slot in enumerate(batch.slots):
            lo, hi = batch.cu_seqlens[b], batch.cu_seqlens[b + 1]
            ids, positions = batch.input_ids[lo:hi], batch.positions[lo:hi]
            replayed = cache.replay_ids[slot]
            if replayed is not None:  # a rollback dropped this slot's state: feed the committed tokens again
                positions = torch.cat([torch.arange(len(replayed), device=self.device), positions])
                ids = torch.cat([replayed, ids])
                cache.replay_ids[slot] = None
            seen = cache.lengths[slot] + hi - lo - len(ids)  # tokens the slot's cache holds before this forward
            if cache.replay:
                cache.fed[slot].append(ids)
            # transformers' state-space layers continue a state one token per forward (a longer input is
            # scanned from a zero state), so a replay pool with a state feeds its tokens one at a time
            step = 1 if cache.replay and seen else len(ids)
            for start in range(0, len(ids), step):
                rows = self._feed(cache.caches[slot], ids[start:start + step], positions[start:start + step],
                                  seen + start, keep=1 if prefill else min(step, hi - lo),
                                  hidden_layers=batch.hidden_layers)
                logits.append(rows.logits)
                if want_hidden:
                    hidden.append(rows.hidden)
            cache.lengths[slot] += hi - lo
        if prefill:
            return ForwardOutput(logits[0][:0], None)
        all_logits = torch.cat(logits)
        out_hidden = torch.cat(hidden) if want_hidden else None
        if wanted is not None:
            all_logits = all_logits[wanted]
            out_hidden = out_hidden[wanted] if out_hidden is not None else None
        return ForwardOutput(all_logits, out_hidden)

    def _feed(self, slot_cache: DynamicCache, ids: torch.Tensor, positions: torch.Tensor, seen: int, keep: int,
              hidden_layers: tuple[int, ...]) -> ForwardOutput:
        """One forward of ``ids`` ``[n]`` at ``positions`` ``[n]`` after the ``seen`` tokens ``slot_cache`` holds;
        returns the last ``keep`` rows' logits ``[keep, V]`` and hidden states ``[keep, len(hidden_layers), H]``."""
        kwargs = {self._cache_argument: slot_cache}
        if self._takes_positions:
            kwargs["position_ids"] = positions[None]
        if self._takes_attention_mask:
            kwargs["attention_mask"] = torch.ones(1, seen + len(ids), dtype=torch.long, device=self.device)
        if self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = keep
        out = self.model(input_ids=ids[None], use_cache=True, output_hidden_states=bool(hidden_layers), **kwargs)
        hidden = (torch.stack([out.hidden_states[i][0, -keep:] for i in hidden_layers], dim=1)
                  if hidden_layers else None)
        return ForwardOutput(out.logits[0, -keep:], hidden)
