"""CUDA graphs of the fast backend's chain forward: one launch instead of hundreds per step.

A graph is captured lazily, once per shape ``(R, T, K, L)``: ``R`` rows (a power of two, at most
the pool's slots), ``T`` tokens per row (a power of two up to :data:`MAX_GRAPH_WIDTH`), ``K``
attended cache entries (:meth:`FastLlamaLM.key_bucket`) and ``L`` the hidden states it returns
beside the logits (``ForwardBatch.hidden_layers``, normalised: the verification forward of a drafter
that reads the target's features, EAGLE, Medusa, MTP, is captured too). Rows are slot-dense: row ``r`` is slot
``r``, its block table row ``r`` of a static table buffer, through which the graph computes where
each cell writes and what each row reads (a gather); a slot with no sequence in the batch is a
dummy row that writes only to the pool's scratch row. Inputs go through static buffers that every
graph of the pool shares; all graphs of a pool share one memory pool (they never run at
once, and each output is consumed before the next replay).

Outside the graph: laying the batch out in the buffers (one pinned host-to-device copy and
two scatters) and picking the wanted logits.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field

import torch

from specdec.models.base import ForwardBatch, to_device
from specdec.models.grid import Grid

MAX_GRAPH_WIDTH = 16
"""Rows feeding more tokens than this (prefills, very long drafts) run eagerly."""

log = logging.getLogger("specdec")

_captures = 0  # CUDA graphs captured in this process


def one_time_setups() -> int:
    """CUDA graphs captured and graphs compiled by torch.compile in this process so far. A step during which
    this grew paid a one-time set-up (seconds on a GPU: a capture, a compile for a new shape
    specialisation), so its time says nothing of what its shape costs (the auto-k policy skips it)."""
    dynamo = sys.modules.get("torch._dynamo.utils")  # not imported: nothing was compiled
    return _captures + (dynamo.counters["stats"]["unique_graphs"] if dynamo is not None else 0)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@dataclass
class GraphSet:
    """The captured graphs of one :class:`~specdec.models.kv_pool.PagedKVPool` and their
    static input buffers (``[max_rows * MAX_GRAPH_WIDTH]`` each; ``starts`` and ``real``, 1 for
    a row that holds a sequence of the batch, ``[max_rows]``; ``table`` ``[max_rows, blocks per slot]``)."""

    max_rows: int
    ids: torch.Tensor
    positions: torch.Tensor
    table: torch.Tensor
    write_index: torch.Tensor
    starts: torch.Tensor
    real: torch.Tensor
    pool: tuple = field(default_factory=torch.cuda.graph_pool_handle)
    graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def allocate(cls, cache, device: torch.device) -> GraphSet:
        num_slots = cache.num_slots
        cells = num_slots * MAX_GRAPH_WIDTH

        def buffer(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.long, device=device)

        table = torch.zeros(num_slots, cache.blocks_for(cache.capacity), dtype=torch.long, device=device)
        return cls(num_slots, buffer(cells), buffer(cells), table, buffer(cells), buffer(num_slots),
                   buffer(num_slots))


def graph_shape(model, batch: ForwardBatch, cache) -> tuple[int, int, int, tuple[int, ...]] | None:
    """``(R, T, K, L)`` of the graph that serves ``batch`` (``L``: the hidden layers it returns, as
    non-negative indices), or None when it must run eagerly."""
    if batch.tree_mask is not None or batch.hidden_rows is not None:
        return None
    width = max(batch.num_tokens)
    if width > MAX_GRAPH_WIDTH:
        return None
    rows = min(_pow2(max(batch.slots) + 1), cache.num_slots)
    needed = max(cache.lengths[s] + c for s, c in zip(batch.slots, batch.num_tokens))
    final = model.num_layers
    layers = tuple(i if i >= 0 else final + 1 + i for i in batch.hidden_layers)
    return rows, _pow2(width), model.key_bucket(needed, cache.capacity), layers


def _fill(graphs: GraphSet, rows: int, width: int, slots: list[int], counts: list[int], cache,
          input_ids: torch.Tensor, positions: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Lay a batch out in the static buffers: row ``r`` is slot ``r`` (blocks reserved for its cells);
    cells of rows with no sequence, and padding cells, write to the pool's scratch row (index -1).
    Returns each flat token's cell ``[N]``."""
    n = rows * width
    nb = graphs.table.shape[1]
    table = [(t + [0] * (nb - len(t)))[:nb] for t in cache.tables[:rows]]
    write_index = [-1] * n
    starts = [0] * rows
    real = [0] * rows
    cells = []
    for slot, count in zip(slots, counts):
        start = cache.lengths[slot]
        starts[slot], real[slot] = start, 1
        write_index[slot * width : slot * width + count] = range(start, start + count)
        cells.extend(range(slot * width, slot * width + count))
    flat_table = [b for t in table for b in t]
    host = to_device(flat_table + write_index + starts + real + cells, device)
    t = len(flat_table)
    graphs.table[:rows].copy_(host[:t].view(rows, nb))
    graphs.write_index[:n].copy_(host[t : t + n])
    graphs.starts[:rows].copy_(host[t + n : t + n + rows])
    graphs.real[:rows].copy_(host[t + n + rows : t + n + 2 * rows])
    cell_index = host[t + n + 2 * rows :]
    graphs.ids[:n].zero_().index_copy_(0, cell_index, input_ids)
    graphs.positions[:n].zero_().index_copy_(0, cell_index, positions)
    return cell_index


def _grid(graphs: GraphSet, rows: int, width: int, key_len: int, block_size: int) -> Grid:
    n = rows * width
    nb = -(-key_len // block_size)
    return Grid(rows, width, key_len, graphs.ids[:n], graphs.positions[:n].view(rows, width),
                graphs.write_index[:n], graphs.starts[:rows], graphs.table[:rows, :nb])


def _captured(graphs: GraphSet, key: tuple, body, refill) -> tuple[torch.cuda.CUDAGraph, object]:
    """The graph of ``key``, capturing ``body()`` first if needed: a warm-up run on a side stream
    (it performs the call for real, also compiling what torch.compile has not yet), ``refill()``
    to restore the inputs the warm-up may have advanced, then the capture."""
    global _captures
    entry = graphs.graphs.get(key)
    if entry is None:
        log.info("specdec: capturing a CUDA graph %s", key)
        _captures += 1
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream().wait_stream(side)
        refill()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=graphs.pool):
            output = body()
        entry = graphs.graphs[key] = (graph, output)
    return entry


def replay(model, batch: ForwardBatch, cache, shape: tuple[int, int, int, tuple[int, ...]]
           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Run ``batch`` through the graph of ``shape`` (capturing it first if needed); returns the
    grid's logits ``[R*T, V]`` and hidden states ``[R*T, L, H]`` (None when ``L`` is empty), both valid
    until the next replay, and each flat token's cell ``[N]``."""
    rows, width, key_len, layers = shape
    graphs: GraphSet = cache.graphs

    def fill() -> torch.Tensor:
        return _fill(graphs, rows, width, batch.slots, batch.num_tokens, cache, batch.input_ids, batch.positions,
                     model.device)

    cell_index = fill()
    grid = _grid(graphs, rows, width, key_len, cache.block_size)

    inner = frozenset(i for i in layers if i < model.num_layers)
    every = slice(None)

    def body() -> tuple[torch.Tensor, torch.Tensor | None]:
        x, hidden = model.compute(grid, cache, inner, capturable=True)
        return model.head(x), model.states(x, hidden, layers, every) if layers else None

    graph, (logits, states) = _captured(graphs, ("forward", *shape), body, fill)
    graph.replay()
    return logits, states, cell_index


def replay_greedy_chain(model, tokens: torch.Tensor, slots: list[int], cache, steps: int) -> torch.Tensor:
    """:meth:`~specdec.models.base.CausalLM.greedy_chain` as one graph: ``steps`` one-token
    forwards, each feeding the previous argmax, with positions and cache indices advanced on
    the device. Returns ``[B, steps]``."""
    graphs: GraphSet = cache.graphs
    rows = min(_pow2(max(slots) + 1), cache.num_slots)
    key_len = model.key_bucket(max(cache.lengths[s] for s in slots) + steps, cache.capacity)
    start_positions = to_device([cache.lengths[s] for s in slots], model.device)

    def fill() -> torch.Tensor:
        return _fill(graphs, rows, 1, slots, [1] * len(slots), cache, tokens, start_positions, model.device)

    def body() -> torch.Tensor:
        grid = _grid(graphs, rows, 1, key_len, cache.block_size)
        real = graphs.real[:rows]
        out = []
        for _ in range(steps):
            token = model.head(model.compute(grid, cache, capturable=True)[0]).argmax(-1)
            out.append(token)
            grid.ids.copy_(token)
            grid.positions.add_(real[:, None])
            grid.starts.add_(real)
            grid.write_index.add_(real)
        return torch.stack(out, dim=1)

    cell_index = fill()
    graph, out = _captured(graphs, ("greedy_chain", rows, key_len, steps), body, fill)
    graph.replay()
    for slot in slots:
        cache.lengths[slot] += steps
    return out[cell_index]
