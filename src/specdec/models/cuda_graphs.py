"""CUDA graphs of the fast backend's forwards: one launch instead of hundreds per step.

A graph is captured lazily, once per shape ``(R, T, K, L)``: ``R`` rows (a power of two, at most
the pool's slots), ``T`` tokens per row (a power of two up to :data:`MAX_GRAPH_WIDTH`), ``K``
attended cache entries (:meth:`FastLlamaLM.key_bucket`) and ``L`` the hidden states it returns
beside the logits (``ForwardBatch.hidden_layers``, normalised: the verification forward of a drafter
that reads the target's features, EAGLE, Medusa, MTP, is captured too). Rows are slot-dense: row ``r`` is slot
``r``, its block table row ``r`` of a static table buffer, through which the graph computes where
each cell writes and what each row reads (a gather); a slot with no sequence in the batch is a
dummy row that writes only to the pool's scratch row. Inputs go through static buffers that every
graph of the pool shares (a forward fed hidden states instead of token ids, the EAGLE layer's, through
``GraphSet.features``; a tree forward's mask bits through ``GraphSet.tree_cells``); all graphs of a pool
share one memory pool (they never run at once, and each output is consumed before the next replay). A
forward's other variants (rows of the output head, a subset of the layers, an exit adapter, a tree) are
part of its graph's key.

Two draft loops are captured whole, ``steps`` one-token forwards each feeding the last argmax
(:func:`replay_greedy_chain`): a draft model's, and a feature drafter's (EAGLE), which also feeds
its last predicted feature through the drafter's input function.

Outside the graph: laying the batch out in the buffers (one pinned host-to-device copy and
two scatters) and picking the wanted logits.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdec.models.base import ForwardBatch, to_device
from specdec.models.grid import Grid, tree_bits, tree_mask

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
    pool: tuple | None = None
    graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, object]] = field(default_factory=dict)
    features: torch.Tensor | None = None
    tree_cells: torch.Tensor | None = None

    def tree_rows(self, cells: int, width: int) -> torch.Tensor:
        """The static buffer of a tree forward's :func:`~.grid.tree_bits`, as ``[cells, width]`` bool (allocated
        by the first fill, ``max_rows * MAX_GRAPH_WIDTH`` rows of ``MAX_GRAPH_WIDTH``, never again)."""
        if self.tree_cells is None:
            self.tree_cells = torch.zeros(self.ids.shape[0] * MAX_GRAPH_WIDTH, dtype=torch.bool,
                                          device=self.ids.device)
        return self.tree_cells[: cells * width].view(cells, width)

    def feature_rows(self, like: torch.Tensor) -> torch.Tensor:
        """The static buffer of fed hidden states, ``[max_rows * MAX_GRAPH_WIDTH, H]`` in ``like``'s width
        and dtype (allocated by the first fill, never again: graphs read its memory)."""
        if self.features is None:
            self.features = like.new_zeros(self.ids.shape[0], like.shape[-1])
        return self.features

    @classmethod
    def allocate(cls, cache, device: torch.device) -> GraphSet:
        num_slots = cache.num_slots
        cells = num_slots * MAX_GRAPH_WIDTH

        def buffer(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.long, device=device)

        table = torch.zeros(num_slots, cache.blocks_for(cache.capacity), dtype=torch.long, device=device)
        pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None  # a CPU: the bodies' tests
        return cls(num_slots, buffer(cells), buffer(cells), table, buffer(cells), buffer(num_slots),
                   buffer(num_slots), pool)


def graph_shape(model, batch: ForwardBatch, cache) -> tuple[int, int, int, tuple[int, ...]] | None:
    """``(R, T, K, L)`` of the graph that serves ``batch`` (``L``: the hidden layers it returns, as
    non-negative indices), or None when it must run eagerly."""
    if batch.hidden_rows is not None:
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


def _key(head: torch.Tensor | None) -> tuple[int, int] | None:
    """A graph key's part for the output head rows ``[V', H]`` it scores with (None: the whole head): their
    storage and count (a slice of the head, even an empty one, shares the head's storage)."""
    return None if head is None else (head.data_ptr(), head.shape[0])


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
    until the next replay, and each flat token's cell ``[N]``. A batch with ``input_hidden`` ``[N, H]``
    feeds those states instead of its tokens' embeddings, one with ``output_head`` ``[V', H]`` scores those rows
    of the head (``[R*T, V']`` logits), one with ``layers`` runs those layers only, one with an
    ``exit_adapter`` scores its output and one with a ``tree_mask`` attends through it (its bits laid out in a
    static buffer, the mask computed in the graph): each a graph of its own."""
    rows, width, key_len, layers = shape
    graphs: GraphSet = cache.graphs
    n, fed, head = rows * width, batch.input_hidden, batch.output_head
    run, adapter, tree = batch.layers, batch.exit_adapter, batch.tree_mask
    run = None if run is None else tuple(run)

    def fill() -> torch.Tensor:
        cells = _fill(graphs, rows, width, batch.slots, batch.num_tokens, cache, batch.input_ids, batch.positions,
                      model.device)
        if fed is not None:
            graphs.feature_rows(fed)[:n].zero_().index_copy_(0, cells, fed)
        if tree is not None:
            tree_bits(tree, cells, rows, width, out=graphs.tree_rows(n, width))
        return cells

    cell_index = fill()
    grid = _grid(graphs, rows, width, key_len, cache.block_size)

    inner = frozenset(i for i in layers if i < model.num_layers)
    every = slice(None)

    def body() -> tuple[torch.Tensor, torch.Tensor | None]:
        x = None if fed is None else graphs.features[:n].view(rows, width, -1)
        if tree is not None:
            grid.mask, grid.key_positions = tree_mask(graphs.tree_rows(n, width), grid)
        x, hidden = model.compute(grid, cache, inner, run, x, capturable=True)
        scored = x if adapter is None else adapter(x)
        return model.head(scored, head), model.states(x, hidden, layers, every) if layers else None

    key = ("forward", *shape, fed is not None, _key(head), run, None if adapter is None else id(adapter),
           tree is not None)
    graph, (logits, states) = _captured(graphs, key, body, fill)
    graph.replay()
    return logits, states, cell_index


def replay_greedy_chain(model, tokens: torch.Tensor, slots: list[int], cache, steps: int,
                        output_head: torch.Tensor | None = None, token_ids: torch.Tensor | None = None,
                        features: torch.Tensor | None = None, inputs: Callable | None = None) -> torch.Tensor:
    """:meth:`~specdec.models.base.CausalLM.greedy_chain` as one graph: ``steps`` one-token
    forwards, each feeding the previous argmax (over the rows ``output_head`` ``[V', H]`` of the head, whose
    token ids are ``token_ids`` ``[V']``, if given), with positions and cache indices advanced on
    the device. With ``features`` ``[B, H]`` and ``inputs`` (a feature drafter's loop), each forward is fed
    ``inputs(feature, token)`` instead of the token's embedding, and the next feature is the forward's final
    hidden state. Returns ``[B, steps]``."""
    graphs: GraphSet = cache.graphs
    rows = min(_pow2(max(slots) + 1), cache.num_slots)
    key_len = model.key_bucket(max(cache.lengths[s] for s in slots) + steps, cache.capacity)
    start_positions = to_device([cache.lengths[s] for s in slots], model.device)

    def fill() -> torch.Tensor:
        cells = _fill(graphs, rows, 1, slots, [1] * len(slots), cache, tokens, start_positions, model.device)
        if features is not None:
            graphs.feature_rows(features)[:rows].zero_().index_copy_(0, cells, features)
        return cells

    def body() -> torch.Tensor:
        grid = _grid(graphs, rows, 1, key_len, cache.block_size)
        real = graphs.real[:rows]
        feature = None if features is None else graphs.features[:rows]
        out = []
        for _ in range(steps):
            x = None if feature is None else inputs(feature, grid.ids).view(rows, 1, -1)
            last = model.compute(grid, cache, x=x, capturable=True)[0]
            token = model.head(last, output_head).argmax(-1)
            if token_ids is not None:
                token = token_ids[token]
            if feature is not None:
                feature = model.final_hidden(last)
            out.append(token)
            grid.ids.copy_(token)
            grid.positions.add_(real[:, None])
            grid.starts.add_(real)
            grid.write_index.add_(real)
        return torch.stack(out, dim=1)

    cell_index = fill()
    key = ("greedy_chain", rows, key_len, steps, features is not None, _key(output_head))
    graph, out = _captured(graphs, key, body, fill)
    graph.replay()
    for slot in slots:
        cache.lengths[slot] += steps
    return out[cell_index]
