"""The fast backend's KV pool: every slot's keys and values preallocated, rollback a length move.

Layers with a sliding window keep every entry too (the window is a mask over the slot, see
:mod:`.grid`): rolling back stays a length move, and a tree's compaction moves entries as in a
global layer. The price is memory: a windowed layer holds ``capacity`` entries, not ``window``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.models.base import KVCache, to_device

if TYPE_CHECKING:
    from specdec.models.cuda_graphs import GraphSet


@dataclass
class StaticKVPool(KVCache):
    """Keys and values per layer, ``[num_slots, kv_heads, capacity + 1, head_dim]`` (the last
    column is scratch for padding cells), zero-filled once (never garbage: masked-out entries
    must stay finite for the attention kernels); ``graphs``: the CUDA graphs captured over it."""

    keys: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None
    graphs: GraphSet | None = None
    gather_scratch: torch.Tensor | None = None  # [2, n]: see gather_buffers

    def gather_buffers(self, rows: int, key_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two ``[rows, kv_heads, key_len, head_dim]`` buffers that a gathered read of one layer's keys
        and values copies into, reused by every layer and forward. The scratch grows when a read needs
        more (to twice its size, at most one layer's keys: few regrowths, and never more memory than
        the largest reads ask for). On a CPU a fresh copy per read was the cost of a gathered forward:
        allocations of megabytes come from the operating system, zeroed page by page, and slowed the
        matrix products after them too (16 rows after 350 cached: 29 ms against 10 ms for consecutive
        slots)."""
        _, heads, _, head_dim = self.keys[0].shape
        shape = (rows, heads, key_len, head_dim)
        size = rows * heads * key_len * head_dim
        if self.gather_scratch is None or self.gather_scratch.shape[1] < size:
            held = 0 if self.gather_scratch is None else self.gather_scratch.shape[1]
            self.gather_scratch = self.keys[0].new_empty((2, max(size, min(2 * held, self.keys[0].numel()))))
        return self.gather_scratch[0, :size].view(shape), self.gather_scratch[1, :size].view(shape)

    def compact(self, slots: Sequence[int], sources: Sequence[int], targets: Sequence[int]) -> None:
        if not slots:
            return
        device = self.keys[0].device
        index = to_device([list(slots), list(sources), list(targets)], device)
        for pool in (*self.keys, *self.values):
            pool[index[0], :, index[2]] = pool[index[0], :, index[1]]  # the gather copies before the write
