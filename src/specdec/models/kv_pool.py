"""The fast backend's paged KV pool: blocks of ``block_size`` tokens, a block table per slot.

Storage per layer is ``[num_blocks * B + 1, kv_heads, head_dim]``, token-major (the last row is
scratch that padding cells write to). Token ``i`` of a slot lives in row ``table[i // B] * B + i % B``.
Blocks are taken when a forward writes past a slot's last block (:meth:`PagedKVPool.reserve`) and
freed whole when a rollback or a release leaves them empty; the scheduler keeps the demand within
the free blocks (admission and preemption, :mod:`specdec.scheduler`), and a forward that would need
more raises :class:`KVPoolExhausted`. The lowest free block is taken first, so a sequence's blocks are
mostly consecutive: a single row whose blocks are is read and written through slices, as the old
slot-major pool was; other reads gather through the table (on a CPU into one scratch buffer).

With prefix caching (:mod:`.prefix_cache`) full blocks of committed tokens are registered by content
and shared by reference count; a shared block is full and lies below every owner's committed length,
so it is never written again (rollback and tree compaction only touch entries past it).

Layers with a sliding window keep every entry too (the window is a mask, see :mod:`.grid`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.errors import SpecDecError
from specdec.models.base import KVCache, to_device
from specdec.models.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from specdec.models.cuda_graphs import GraphSet

BLOCK_SIZE = 16
"""Tokens per block (measured in docs/lab-notes/2026-11-24-paged.md: 16 and 32 decode alike on a CPU;
16 wastes less of a short request's last block and shares prefixes at a finer grain, as in vLLM)."""


class KVPoolExhausted(SpecDecError):
    """A forward needed more KV blocks than the pool has free (the scheduler preempts before this)."""


@dataclass
class PagedKVPool(KVCache):
    """Keys and values per layer, ``[num_blocks * block_size + 1, kv_heads, head_dim]``, zero-filled once
    (masked-out entries must stay finite); ``tables[s]``: the blocks of slot ``s`` in token order;
    ``graphs``: the CUDA graphs captured over it; ``prefix``: the prefix cache, or None."""

    block_size: int = BLOCK_SIZE
    num_blocks: int = 0
    keys: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None
    graphs: GraphSet | None = None
    gather_scratch: torch.Tensor | None = None  # [2, n]: see gather_buffers
    prefix: PrefixCache | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.tables: list[list[int]] = [[] for _ in range(self.num_slots)]
        self.refs = [0] * self.num_blocks
        self._free = list(range(self.num_blocks))  # a heap: the lowest block first
        self._run = [0] * self.num_slots  # leading blocks of each table that are consecutive
        self._registered = [0] * self.num_slots  # leading blocks of each table in the prefix cache
        self._parent = [0] * self.num_slots  # content id of the last of them (0: none)

    # ------------------------------------------------------------------ accounting
    @property
    def scratch_row(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, length: int) -> int:
        """Blocks that hold ``length`` tokens."""
        return -(-length // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take: free ones and unreferenced cached ones (evicted on demand)."""
        return len(self._free) + (len(self.prefix.evictable) if self.prefix is not None else 0)

    @property
    def caches_prefixes(self) -> bool:
        return self.prefix is not None

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by some slot."""
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, slot: int, length: int) -> int:
        """Blocks slot ``slot`` must still take to hold ``length`` tokens."""
        return max(0, self.blocks_for(length) - len(self.tables[slot]))

    def reserve(self, slot: int, length: int) -> None:
        """Give slot ``slot`` the blocks that ``length`` tokens need (a forward calls it before writing)."""
        if length > self.capacity:
            raise ValueError(f"slot {slot} cannot hold {length} tokens (capacity {self.capacity})")
        need = self.blocks_needed(slot, length)
        if need > self.num_free_blocks:
            raise KVPoolExhausted(
                f"the KV pool has {self.num_free_blocks} free blocks of {self.block_size} tokens but slot {slot} "
                f"needs {need} more; raise --kv-cache-memory or lower --max-num-seqs")
        table = self.tables[slot]
        for _ in range(need):
            block = heapq.heappop(self._free) if self._free else self.prefix.evict_oldest()
            self.refs[block] = 1
            if self._run[slot] == len(table) and (not table or block == table[-1] + 1):
                self._run[slot] += 1
            table.append(block)

    def _drop(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if self.prefix is not None and self.prefix.is_registered(block):
                self.prefix.evictable[block] = None  # the most recently used end
            else:
                heapq.heappush(self._free, block)

    def set_length(self, slot: int, length: int) -> None:
        """Roll back to ``length`` tokens, freeing the blocks past them."""
        super().set_length(slot, length)
        table, keep = self.tables[slot], self.blocks_for(length)
        while len(table) > keep:
            self._drop(table.pop())
        self._run[slot] = min(self._run[slot], keep)
        if self._registered[slot] > keep:  # only a release goes below the committed length
            self._registered[slot], self._parent[slot] = 0, 0

    def rewind(self, slot: int, length: int) -> None:
        KVCache.set_length(self, slot, length)

    # ------------------------------------------------------------------ prefix caching
    def match_prefix(self, slot: int, tokens: Sequence[int]) -> int:
        """Share the cached full blocks that begin ``tokens[:-1]`` (``tokens`` a context whose last token
        is pending) into empty slot ``slot``; returns the tokens now cached (a multiple of the block size)."""
        if self.prefix is None:
            return 0
        if self.lengths[slot]:
            raise ValueError(f"slot {slot} is not empty")
        size, table, parent = self.block_size, self.tables[slot], 0
        self.prefix.queries += len(tokens)
        for i in range((len(tokens) - 1) // size):
            found = self.prefix.lookup(parent, tokens[i * size : (i + 1) * size])
            if found is None:
                break
            block, parent = found
            if self.refs[block] == 0:
                del self.prefix.evictable[block]
            self.refs[block] += 1
            if self._run[slot] == len(table) and (not table or block == table[-1] + 1):
                self._run[slot] += 1
            table.append(block)
        cached = len(table) * size
        self.prefix.hits += cached
        self._registered[slot], self._parent[slot] = len(table), parent
        self.lengths[slot] = cached
        return cached

    def prefix_cache_counts(self) -> tuple[int, int]:
        return (self.prefix.queries, self.prefix.hits) if self.prefix is not None else (0, 0)

    def commit_prefix(self, slot: int, tokens: Sequence[int]) -> None:
        """Register slot ``slot``'s full blocks of committed tokens (``tokens``, its context) not yet
        registered. Call it only when every cached entry of the slot is committed (after a step's
        rollback)."""
        if self.prefix is None:
            return
        size, table = self.block_size, self.tables[slot]
        full = min(self.lengths[slot], len(tokens)) // size
        parent = self._parent[slot]
        for i in range(self._registered[slot], full):
            parent = self.prefix.register(table[i], parent, tokens[i * size : (i + 1) * size])
        if full > self._registered[slot]:
            self._registered[slot], self._parent[slot] = full, parent

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no slot references."""
        if self.prefix is None:
            return
        while self.prefix.evictable:
            heapq.heappush(self._free, self.prefix.evict_oldest())

    # ------------------------------------------------------------------ addressing
    def rows_of(self, slot: int, start: int, count: int) -> list[int]:
        """Storage rows of entries ``start .. start+count-1`` of slot ``slot`` (blocks reserved)."""
        table, size = self.tables[slot], self.block_size
        return [table[i // size] * size + i % size for i in range(start, start + count)]

    def consecutive_rows(self, slot: int, length: int) -> int | None:
        """The storage row of slot ``slot``'s entry 0 when its first ``length`` entries are consecutive rows
        (a slice reads them), else None."""
        if self.blocks_for(length) > self._run[slot] or not self.tables[slot]:
            return None
        return self.tables[slot][0] * self.block_size

    def table_tensor(self, slots: Sequence[int], key_len: int, device: torch.device) -> torch.Tensor:
        """The block tables of ``slots`` over ``key_len`` entries, ``[R, ceil(key_len / B)]`` (a slot with fewer
        blocks is padded with block 0: those entries are masked)."""
        width = self.blocks_for(key_len)
        rows = [(t[:width] + [0] * (width - len(t)))[:width] for t in (self.tables[s] for s in slots)]
        return to_device(rows, device)

    def gather_buffers(self, rows: int, key_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two ``[rows * key_len, kv_heads, head_dim]`` buffers that a gathered read of one layer's keys
        and values copies into, reused by every layer and forward. The scratch grows when a read needs
        more (to twice its size, at most one layer's keys: few regrowths, and never more memory than
        the largest reads ask for). On a CPU a fresh copy per read was the cost of a gathered forward:
        allocations of megabytes come from the operating system, zeroed page by page, and slowed the
        matrix products after them too (16 rows after 350 cached: 29 ms against 10 ms for a slice)."""
        _, heads, head_dim = self.keys[0].shape
        shape = (rows * key_len, heads, head_dim)
        size = rows * key_len * heads * head_dim
        if self.gather_scratch is None or self.gather_scratch.shape[1] < size:
            held = 0 if self.gather_scratch is None else self.gather_scratch.shape[1]
            self.gather_scratch = self.keys[0].new_empty((2, max(size, min(2 * held, self.keys[0].numel()))))
        return self.gather_scratch[0, :size].view(shape), self.gather_scratch[1, :size].view(shape)

    def compact(self, slots: Sequence[int], sources: Sequence[int], targets: Sequence[int]) -> None:
        if not slots:
            return
        rows = [self.rows_of(s, i, 1)[0] for s, i in (*zip(slots, sources), *zip(slots, targets))]
        index = to_device(rows, self.keys[0].device)
        src, dst = index[: len(slots)], index[len(slots) :]
        for pool in (*self.keys, *self.values):
            pool[dst] = pool[src]  # the gather copies before the write
