"""Automatic prefix caching: full KV blocks found again by their content.

A full block of ``B`` committed tokens is keyed by ``(parent, tokens)``: ``tokens`` the block's own
token ids, ``parent`` the content id of the block before it (0 for the first block). The key holds
the tokens themselves, not a hash of them, so a lookup is exact (a hash collision costs a
comparison, never a wrong block); content ids are never reused, so a key whose parent was evicted
is unreachable and can never match a new block that happens to reuse the parent's storage.

A registered block stays in the cache while sequences reference it and after (then it is
*evictable*, kept in least-recently-used order); :class:`~.kv_pool.PagedKVPool` takes evictable
blocks only when no block is free, oldest first.

:class:`BlockFeatures` keeps the target's hidden states of the same rows, for the drafters that read them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specdec.models.base import to_device

if TYPE_CHECKING:
    from specdec.models.kv_pool import PagedKVPool

Key = tuple[int, tuple[int, ...]]


class PrefixCache:
    """The content index of one pool's blocks: key -> (block, content id), and the evictable blocks."""

    def __init__(self) -> None:
        self.by_key: dict[Key, tuple[int, int]] = {}
        self.key_of: dict[int, Key] = {}  # registered block -> its key
        self.cid_of: dict[int, int] = {}  # registered block -> its content id
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced registered blocks, LRU first
        self._next_cid = 1
        self.queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of them found cached (prefix_cache_hits)

    def lookup(self, parent: int, tokens: Sequence[int]) -> tuple[int, int] | None:
        """``(block, content id)`` of the registered block holding ``tokens`` after ``parent``, or None."""
        return self.by_key.get((parent, tuple(tokens)))

    def register(self, block: int, parent: int, tokens: Sequence[int]) -> int:
        """Index ``block`` (full, committed) under ``(parent, tokens)``; returns its content id. When the
        same content is already registered (another sequence computed it too), ``block`` stays private
        and the registered block's content id is returned (the chain of keys is the same)."""
        key = (parent, tuple(tokens))
        found = self.by_key.get(key)
        if found is not None:
            return found[1]
        cid = self._next_cid
        self._next_cid += 1
        self.by_key[key] = (block, cid)
        self.key_of[block] = key
        self.cid_of[block] = cid
        return cid

    def is_registered(self, block: int) -> bool:
        return block in self.key_of

    def evict_oldest(self) -> int:
        """Forget the least recently used evictable block and return it (now free storage)."""
        block, _ = self.evictable.popitem(last=False)
        del self.by_key[self.key_of.pop(block)]
        del self.cid_of[block]
        return block

    def reset(self) -> None:
        """Forget every registered block (their storage is the pool's to free)."""
        self.by_key.clear()
        self.key_of.clear()
        self.cid_of.clear()
        self.evictable.clear()


class BlockFeatures:
    """The target's hidden states of a paged pool's cached entries, row for row with its keys and values, for
    a drafter that reads them (EAGLE, EAGLE-3, Medusa, MTP): a prefix-cache hit hands such a drafter the
    hidden states of the cached context, which the target does not compute again, so the drafter starts
    from exactly the states it would have had without the cache. ``rows`` ``[num_blocks * B, L, H]`` (``L``
    the layers the drafter reads, ``H`` the hidden width) is allocated at the first write; a shared block's
    rows were written by the sequence that computed it, and are never written again, like its keys."""

    def __init__(self, pool: PagedKVPool) -> None:
        self.pool = pool
        self.rows: torch.Tensor | None = None

    def write(self, index: list[int], hidden: torch.Tensor) -> None:
        """Store ``hidden`` ``[n, L, H]`` at pool rows ``index`` (``n`` of them, from :meth:`PagedKVPool.rows_of`)."""
        if self.rows is None:
            self.rows = hidden.new_empty((self.pool.num_blocks * self.pool.block_size, *hidden.shape[1:]))
        self.rows[to_device(index, hidden.device)] = hidden

    def read(self, slot: int, count: int) -> torch.Tensor:
        """The hidden states of slot ``slot``'s first ``count`` entries, ``[count, L, H]`` (``count`` > 0, written)."""
        return self.rows[to_device(self.pool.rows_of(slot, 0, count), self.rows.device)]
