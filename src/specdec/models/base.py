"""The model contract every backend implements: one batched forward over a pool of KV slots.

Terms (shapes are the point):

- ``B`` rows: the sequences of one forward. Row ``b`` owns slot ``slots[b]`` of the KV cache.
- ``N`` new tokens, flat: row ``b``'s tokens are ``input_ids[cu_seqlens[b]:cu_seqlens[b+1]]``
  (ragged: every row may feed a different number of tokens, at least one).
- ``positions`` ``[N]``: the rotary/absolute position of each new token. For a chain they
  are ``L_b, L_b+1, ...`` where ``L_b`` is the slot's cached length; for a tree, each node's
  depth below ``L_b``.
- cache index: new token ``i`` of row ``b`` is written at index ``L_b + i`` of its slot, in
  feeding order, whatever its position; afterwards the slot's length is ``L_b + n_b``.
- ``tree_mask`` ``[N, T_max]`` bool or None: ``tree_mask[n, j]`` says whether new token ``n``
  attends to new token ``j`` of its own row (``T_max`` the longest row). None is a causal
  chain. Every token always attends to the slot's ``L_b`` committed entries.
- ``logits_rows`` ``[M]``: flat indices (into ``N``) whose logits are returned, a device tensor
  or a host ``slice``; None is all ``N``; an empty tensor skips the output head (a prefill).
- ``hidden_layers``: indices into transformers' ``hidden_states`` tuple (0 the embeddings,
  ``i`` the output of layer ``i``, ``-1`` the final, normed one) returned for the same rows.
- ``layers``: the decoder layers run, ascending (None: all); the others are skipped, their cache
  entries for the new tokens left as they were (self-speculation drafts with a subset).
- ``input_hidden`` ``[N, H]`` or None: the input of ``layers[0]`` for each new token instead of
  the embeddings (verification resuming where a draft that ran the first layers stopped).
- ``exit_adapter``: a function ``[M, H] -> [M, H]`` applied to the last run layer's output of the
  wanted rows before the final norm and the output head (a trained early exit); the returned
  hidden states are the layers' own.
- ``output_head`` ``[V', H]`` or None: score the wanted rows with these rows of the output head
  instead of the whole ``[V, H]`` head (a drafter's reduced vocabulary: logits are ``[M, V']``);
  ``[0, H]`` skips the head while the hidden states are still returned.
  These four need a backend with ``supports_layer_subsets``.
- ``hidden_rows`` ``[M']`` or None: flat indices whose hidden states are returned when they are not
  ``logits_rows`` (a decoding step's logits, with the states of the prompt chunks fed beside it too);
  None: the same rows. Needs a backend with ``fuses_prefill``.
- ``chunk_rows``: how many of the last rows are prompt chunks fed beside a decoding step's rows (chains,
  no subsets); a backend with ``fuses_prefill`` lays each out apart from the step's rows.

Rolling back is setting a slot's length (``cache.set_length``): rejected draft entries are
forgotten without touching the accepted ones. After a tree step the accepted path's entries are
first moved to contiguous indices (``cache.compact``).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from specdec.argmax import argmax
from specdec.errors import SpecDecError


def to_device(values: list | torch.Tensor, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host list or CPU tensor on ``device`` without a host sync: through pinned memory on
    CUDA (a copy from pageable memory would wait for the device to finish its queue)."""
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


@dataclass
class ForwardBatch:
    """The inputs of one forward (see the module docstring for every term).

    ``input_ids`` and ``positions`` ``[N]`` int64 on the model's device; ``slots`` and
    ``cu_seqlens`` (``B`` and ``B+1`` ints) on the host, since they decide shapes.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: list[int]
    cu_seqlens: list[int]
    tree_mask: torch.Tensor | None = None
    logits_rows: torch.Tensor | slice | None = None
    hidden_layers: tuple[int, ...] = ()
    layers: tuple[int, ...] | None = None
    input_hidden: torch.Tensor | None = None
    exit_adapter: Callable[[torch.Tensor], torch.Tensor] | None = None
    output_head: torch.Tensor | None = None
    hidden_rows: torch.Tensor | slice | None = None
    chunk_rows: int = 0

    @property
    def num_rows(self) -> int:
        return len(self.slots)

    @cached_property
    def num_tokens(self) -> list[int]:
        """Tokens fed per row, ``[B]``."""
        return [b - a for a, b in zip(self.cu_seqlens, self.cu_seqlens[1:])]

    @classmethod
    def one_token_per_row(cls, tokens: torch.Tensor, slots: Sequence[int], cache: KVCache) -> ForwardBatch:
        """Row ``b`` feeds ``tokens[b]`` (``[B]`` on the device) into slot ``slots[b]`` at its cached length."""
        positions = to_device([cache.lengths[s] for s in slots], tokens.device)
        return cls(tokens, positions, list(slots), list(range(len(slots) + 1)))

    @classmethod
    def from_rows(
        cls, rows: Sequence[Sequence[int]], starts: Sequence[int], slots: Sequence[int], device: torch.device,
        logits: str = "all",
    ) -> ForwardBatch:
        """A chain batch from host token lists: row ``b`` feeds ``rows[b]`` at positions
        ``starts[b]..``. ``logits``: ``"all"``, ``"last"`` (each row's last token) or ``"none"``."""
        cu = [0]
        flat: list[int] = []
        pos: list[int] = []
        for tokens, start in zip(rows, starts):
            flat.extend(tokens)
            pos.extend(range(start, start + len(tokens)))
            cu.append(len(flat))
        data = to_device([flat, pos], device)
        if logits == "last":
            wanted = slice(cu[1] - 1, cu[1]) if len(rows) == 1 else to_device([c - 1 for c in cu[1:]], device)
        elif logits == "none":
            wanted = torch.empty(0, dtype=torch.long, device=device)
        else:
            wanted = None
        return cls(data[0], data[1], list(slots), cu, logits_rows=wanted)


PREFILL_TOKEN_BUDGET = 4096
"""Padded tokens (rows x longest row) of one prefill forward: the attention mask and the
activations of a ragged prefill grow with rows x length, so long prompts go a few at a time."""


def prefill_batches(
    rows: Sequence[Sequence[int]], slots: Sequence[int], device: torch.device, budget: int = PREFILL_TOKEN_BUDGET,
    starts: Sequence[int] | None = None,
) -> list[ForwardBatch]:
    """Prompts into slots in as few forwards as ``budget`` allows: row ``b`` feeds ``rows[b]`` into slot
    ``slots[b]`` from position ``starts[b]`` (default 0: an empty slot; a later chunk of a prompt
    continues where the slot's cache ends), no logits wanted."""
    starts = [0] * len(rows) if starts is None else starts
    batches, group = [], []
    for row, slot, start in sorted(zip(rows, slots, starts), key=lambda item: len(item[0])):
        if group and (len(group) + 1) * len(row) > budget:
            batches.append(group)
            group = []
        group.append((row, slot, start))
    if group:
        batches.append(group)
    return [ForwardBatch.from_rows([r for r, _, _ in g], [p for _, _, p in g], [s for _, s, _ in g], device,
                                   logits="none") for g in batches]


POOL_MEMORY_FRACTION = 0.9
"""The share of the available memory a KV pool may take when it is allocated (the rest is left to
the activations of the forwards and to whatever else runs)."""

GIB = 1 << 30


def available_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on ``device``: free device memory on CUDA, the kernel's
    ``MemAvailable`` (or the free physical pages) on a CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_pool_fits(num_bytes: int, num_slots: int, capacity: int, device: torch.device, owner: str,
                    tokens: int | None = None) -> None:
    """Raise :class:`SpecDecError` before allocating a KV pool of ``num_bytes`` (``tokens`` tokens in all,
    by default ``num_slots`` slots of ``capacity`` tokens, for model ``owner``) that does not fit
    :data:`POOL_MEMORY_FRACTION` of the memory available on ``device``; the message names the knobs
    that shrink it."""
    available = available_memory(device)
    if num_bytes > POOL_MEMORY_FRACTION * available:
        size = f"{num_slots} slots x {capacity} tokens" if tokens is None else f"{tokens} tokens"
        raise SpecDecError(
            f"the KV cache of {owner!r} needs {num_bytes / GIB:.2f} GiB ({size}) but "
            f"{available / GIB:.2f} GiB of {device.type} memory is available, of which a pool may take "
            f"{POOL_MEMORY_FRACTION:.0%}; lower max_model_len (tokens per "
            f"sequence) or max_num_seqs (sequences at once), e.g. --max-model-len / --max-num-seqs, or set "
            f"--kv-cache-memory"
        )


@dataclass
class ForwardOutput:
    """``logits`` ``[M, V]`` of the wanted rows; ``hidden`` ``[M, len(hidden_layers), H]`` or None."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


@dataclass
class KVCache(ABC):
    """A pool of ``num_slots`` sequences' keys and values, ``capacity`` tokens each.

    ``lengths[s]`` is the number of tokens cached in slot ``s`` (host ints: they decide
    shapes and are known after every step's one read of the verified tokens).
    """

    num_slots: int
    capacity: int
    lengths: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.lengths = [0] * self.num_slots

    def set_length(self, slot: int, length: int) -> None:
        """Roll slot ``slot`` back to its first ``length`` tokens (``length <= lengths[slot]``)."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot roll slot {slot} of {self.lengths[slot]} tokens back to {length}")
        self.lengths[slot] = length

    def release(self, slot: int) -> None:
        """Forget slot ``slot`` (its sequence finished or was aborted)."""
        self.set_length(slot, 0)

    def rewind(self, slot: int, length: int) -> None:
        """:meth:`set_length` that keeps the storage past ``length`` where it is (a paged pool keeps its
        blocks): a drafter that wrote entries the next forward reuses in place (layer skip's first layers)."""
        self.set_length(slot, length)

    # Block accounting for admission and preemption. A pool that is not paged (the fallback
    # backend's) holds any sequence that has a slot: it needs no blocks and never runs out.
    block_size: int = field(default=1, init=False)
    num_blocks: int = field(default=0, init=False)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can still take."""
        return 0

    @property
    def caches_prefixes(self) -> bool:
        """Whether :meth:`match_prefix` can find anything (prefix caching is on)."""
        return False

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by some slot."""
        return 0

    def blocks_needed(self, slot: int, length: int) -> int:
        """Blocks slot ``slot`` must still take to hold ``length`` tokens."""
        return 0

    def blocks_for(self, length: int) -> int:
        """Blocks that hold ``length`` tokens."""
        return 0

    def prefix_cache_counts(self) -> tuple[int, int]:
        """Context tokens looked up in the prefix cache so far, and of them the tokens found cached."""
        return 0, 0

    def match_prefix(self, slot: int, tokens: Sequence[int]) -> int:
        """Share cached blocks of ``tokens[:-1]``'s prefix into empty slot ``slot``; returns the tokens now
        cached (0 without prefix caching)."""
        return 0

    def commit_prefix(self, slot: int, tokens: Sequence[int]) -> None:  # noqa: B027 - nothing to register
        """Make slot ``slot``'s full blocks of committed ``tokens`` findable by :meth:`match_prefix`."""

    def reset_prefix_cache(self) -> None:  # noqa: B027 - nothing cached without prefix caching
        """Forget every cached block no slot references."""

    def compact(self, slots: Sequence[int], sources: Sequence[int], targets: Sequence[int]) -> None:
        """Copy cached entries within slots, every layer: entry ``sources[i]`` of slot ``slots[i]`` to
        index ``targets[i]`` (all read before any is written; lengths unchanged). After a tree step
        this makes the accepted path contiguous (:func:`specdec.tree.compaction_moves`); a backend
        without tree masks never receives one."""
        raise SpecDecError(f"{type(self).__name__} cannot compact its entries (tree drafts need the fast backend)")


class CausalLM(ABC):
    """A causal LM backend: builds its KV pool and runs the batched forward over it.

    Attributes set by each backend: ``vocab_size`` (logit width), ``max_length`` (context
    window in tokens), ``device``, ``dtype``, ``name`` (folder or id, for messages),
    ``config`` (the transformers config), ``num_layers`` (decoder layers), ``supports_tree_mask``
    and ``supports_layer_subsets`` (``ForwardBatch.layers`` and ``input_hidden``), ``pads_rows``
    (a forward computes every row as long as the longest, so its cost follows rows x longest row,
    not the tokens fed), ``fuses_prefill`` (a forward whose leading rows decode and whose later rows are
    prompt chunks costs about its tokens, not rows x longest row, and it takes ``hidden_rows``: the
    engine feeds prompt chunks in its decoding step's forward), ``backend_reason`` (why the loader chose
    this backend, one clause, or None), ``packed_head`` (the output head ``[V, H]`` in the form the CPU's
    products read fastest, :func:`~specdec.models.cpu_linear.packed_copy`, for drafters that score with the
    target's head; None: use the plain head).
    """

    vocab_size: int
    max_length: int
    device: torch.device
    dtype: torch.dtype
    name: str
    num_layers: int
    supports_tree_mask: bool = False
    supports_layer_subsets: bool = False
    pads_rows: bool = False
    fuses_prefill: bool = False
    backend_reason: str | None = None
    packed_head: torch.Tensor | None = None

    @abstractmethod
    def new_cache(self, num_slots: int, capacity: int, num_blocks: int | None = None,
                  prefix_caching: bool = False) -> KVCache:
        """Allocate the KV pool once: ``num_slots`` slots of ``capacity`` tokens each, in ``num_blocks``
        blocks in all (None: enough for every slot to be full) where the backend pages its pool, with
        prefix caching where it supports it (a backend that does not ignores both)."""

    def kv_bytes_per_token(self) -> int | None:
        """Bytes one token's keys and values take in the pool (every layer), or None when unknown."""
        return None

    def step_weight_bytes(self) -> int | None:
        """Bytes of weights one decoding step reads, as this backend stores them (one embedding row, every
        layer's matrices, the output head), or None when unknown."""
        return None

    @abstractmethod
    def forward(self, batch: ForwardBatch, cache: KVCache) -> ForwardOutput:
        """Write the batch's keys and values into its slots, advance their lengths and return
        the wanted logits (and hidden states)."""

    def greedy_chain(self, tokens: torch.Tensor, slots: list[int], cache: KVCache, steps: int,
                     output_head: torch.Tensor | None = None, token_ids: torch.Tensor | None = None,
                     features: torch.Tensor | None = None, inputs: Callable | None = None) -> torch.Tensor:
        """Greedy continuation of one token per row: feed ``tokens`` ``[B]`` (row ``b`` into slot
        ``slots[b]`` at its cached length), then each row's argmax, ``steps`` forwards in all.
        Returns the argmax after every fed token, ``[B, steps]``; each slot grows by ``steps``.
        The draft loop of a greedy draft model; a backend may run it as one captured graph.
        With ``output_head`` ``[V', H]`` (:attr:`ForwardBatch.output_head`), the argmax is over those rows
        of the head only, ``token_ids`` ``[V']`` their token ids.
        With ``features`` ``[B, H]`` and ``inputs``, the draft loop of a feature drafter (an EAGLE layer): each
        forward is fed ``inputs(feature, token)`` ``[B, H]`` (``input_hidden``) instead of the token's embedding,
        starting from ``features``, and the next feature is the forward's final hidden state
        (``hidden_layers`` ``(-1,)``).
        """
        out = []
        for _ in range(steps):
            batch = ForwardBatch.one_token_per_row(tokens, slots, cache)
            batch.output_head = output_head
            if inputs is not None:
                batch.hidden_layers, batch.input_hidden = (-1,), inputs(features, tokens)
            result = self.forward(batch, cache)
            tokens = argmax(result.logits)
            if token_ids is not None:
                tokens = token_ids[tokens]
            if inputs is not None:
                features = result.hidden[:, 0]
            out.append(tokens)
        return torch.stack(out, dim=1)

    def check_fits(self, batch: ForwardBatch, cache: KVCache) -> None:
        """Raise ValueError when a row would write past its slot's capacity."""
        for slot, count in zip(batch.slots, batch.num_tokens):
            if cache.lengths[slot] + count > cache.capacity:
                raise ValueError(
                    f"{self.name}: slot {slot} holds {cache.lengths[slot]} tokens and cannot take {count} more "
                    f"(capacity {cache.capacity})"
                )
