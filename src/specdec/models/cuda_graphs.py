"""CUDA graphs of the fast backend's chain forward: one launch instead of hundreds per step.

A graph is captured lazily, once per shape ``(R, T, K)``: ``R`` rows (a power of two, at most
the pool's slots), ``T`` tokens per row (a power of two up to :data:`MAX_GRAPH_WIDTH`) and ``K``
attended cache entries (:meth:`FastLlamaLM.key_bucket`). Rows are slot-dense: row ``r`` is slot
``r``, so the pool is sliced, never gathered, and a slot with no sequence in the batch is a
dummy row that writes only to its scratch column. Inputs go through static buffers that every
graph of the pool shares; all graphs of a pool share one memory pool (they never run at
once, and each output is consumed before the next replay).

Outside the graph: laying the batch out in the buffers (one pinned host-to-device copy and
two scatters) and picking the wanted logits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from specdec.models.base import ForwardBatch, to_device

MAX_GRAPH_WIDTH = 16
"""Rows feeding more tokens than this (prefills, very long drafts) run eagerly."""

log = logging.getLogger("specdec")


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@dataclass
class GraphSet:
    """The captured graphs of one :class:`~specdec.models.fast_llama.StaticKVPool` and their
    static input buffers (``[max_rows * MAX_GRAPH_WIDTH]`` each, ``starts`` ``[max_rows]``)."""

    max_rows: int
    ids: torch.Tensor
    positions: torch.Tensor
    write_slot: torch.Tensor
    write_index: torch.Tensor
    starts: torch.Tensor
    pool: tuple = field(default_factory=torch.cuda.graph_pool_handle)
    graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def allocate(cls, num_slots: int, device: torch.device) -> GraphSet:
        cells = num_slots * MAX_GRAPH_WIDTH

        def buffer(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.long, device=device)

        return cls(num_slots, buffer(cells), buffer(cells), buffer(cells), buffer(cells), buffer(num_slots))


def graph_shape(model, batch: ForwardBatch, cache) -> tuple[int, int, int] | None:
    """``(R, T, K)`` of the graph that serves ``batch``, or None when it must run eagerly."""
    if batch.tree_mask is not None or batch.hidden_layers:
        return None
    width = max(batch.num_tokens)
    if width > MAX_GRAPH_WIDTH:
        return None
    rows = min(_pow2(max(batch.slots) + 1), cache.num_slots)
    needed = max(cache.lengths[s] + c for s, c in zip(batch.slots, batch.num_tokens))
    return rows, _pow2(width), model.key_bucket(needed, cache.capacity)


def replay(model, batch: ForwardBatch, cache, shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``batch`` through the graph of ``shape`` (capturing it first if needed); returns the
    grid's logits ``[R*T, V]`` (valid until the next replay) and each flat token's cell ``[N]``."""
    from specdec.models.fast_llama import Grid

    rows, width, key_len = shape
    graphs: GraphSet = cache.graphs
    n = rows * width
    write_slot = [r for r in range(rows) for _ in range(width)]
    write_index = [cache.capacity] * n
    starts = [0] * rows
    cells = []
    for slot, count in zip(batch.slots, batch.num_tokens):
        start = cache.lengths[slot]
        starts[slot] = start
        write_index[slot * width : slot * width + count] = range(start, start + count)
        cells.extend(range(slot * width, slot * width + count))
    host = to_device(write_slot + write_index + starts + cells, model.device)
    graphs.write_slot[:n].copy_(host[:n])
    graphs.write_index[:n].copy_(host[n : 2 * n])
    graphs.starts[:rows].copy_(host[2 * n : 2 * n + rows])
    cell_index = host[2 * n + rows :]
    graphs.ids[:n].zero_().index_copy_(0, cell_index, batch.input_ids)
    graphs.positions[:n].zero_().index_copy_(0, cell_index, batch.positions)
    entry = graphs.graphs.get(shape)
    if entry is None:
        grid = Grid(rows, width, key_len, graphs.ids[:n], graphs.positions[:n].view(rows, width),
                    graphs.write_slot[:n], graphs.write_index[:n], graphs.starts[:rows], graphs.starts[:rows], 0)
        log.info("specdec: capturing a CUDA graph of %s for %d rows x %d tokens, %d cached", model.name, *shape)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model.head(model.compute(grid, cache)[0])  # warm-up: also performs this batch's forward
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=graphs.pool):
            logits = model.head(model.compute(grid, cache)[0])
        entry = graphs.graphs[shape] = (graph, logits)
    graph, logits = entry
    graph.replay()
    return logits, cell_index
