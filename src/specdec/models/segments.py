"""One fast forward over rows of very different lengths: a decoding step's rows with prompt chunks fed in
the same forward (chunked prefill fused into the step, :mod:`specdec.scheduler`), or any ragged batch (prompts
fed together, a drafter catching up on the tokens of several steps).

A :class:`~.grid.Grid` computes ``R x T`` cells for ``R`` rows of at most ``T`` tokens, so a 64-token prompt
chunk beside 16 one-token rows would compute 17 x 64 cells for 80 tokens. Here the rows are cut into
*segments*, each laid out as its own grid: each prompt chunk (``ForwardBatch.chunk_rows``, the batch's last
rows) alone, and the other rows grouped by the width their grid pads them to (:func:`width_groups`), then by
how far back they attend (:func:`key_groups`). Every matrix product of a layer runs once over the cells of all
segments, as one flat ``[1, C, H]`` block; only the cache writes and the attention run per segment, each over
its own grid and mask.

Why by key length: a grid attends every row to the longest row's cache, gathering ``R x K`` entries per layer
(on a CPU, a copy through the block tables) and attending over all of them under a mask. One long conversation
among short ones made every row pay for its length: on the embedded pair's target, 16 one-token rows after 150
cached tokens took 32 ms, and the same rows with one more after 448 took 57 ms
(``docs/lab-notes/2026-11-29-flood.md``).

Why: on a CPU a small model's forward has a fixed cost per call that a separate prefill forward pays a
second time, and a padded grid pays for its padding. On the embedded pair's target (2 cores, float32, 200
cached tokens; medians, two runs: ``docs/lab-notes/2026-11-28-fused-prefill.md``), one decoding row and a
16-token chunk took 32-35 ms as segments, 39-49 ms apart and 40-42 ms as one padded grid (the row alone: 14-19
ms); 16 rows and a 64-token chunk took 86-94 ms as segments, 99-119 ms apart and 436-466 ms as one grid. The
EAGLE layer's catch-up in a 64-stream server fed 1,234 tokens of 47 rows (10-104 tokens each) as a 50 x 128
grid, 6,400 cells: 0.57-0.72 s, where its segments take 1,495 cells
(``docs/lab-notes/2026-11-28-ragged.md``).
"""

from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from specdec.models.base import ForwardBatch, to_device
from specdec.models.grid import Grid, attention_view, padded_width, storage_rows, wide_bucket
from specdec.models.kv_pool import PagedKVPool
from specdec.models.layers import attend, routed_experts

if TYPE_CHECKING:
    from specdec.models.fast_llama import FastLlamaLM


SEGMENT_CELLS = 16
"""What one more segment costs, in grid cells (its attention and cache calls per layer): rows are split by
width only where that saves more cells than this per extra segment."""


SEGMENT_KEYS = 512
"""What one more segment costs, in attended cache entries (rows x keys): rows are split by key length only where
that saves more entries than this per extra segment (of 128, 512 and 2048, 512 was best or near it on the
embedded pair's target, ``docs/lab-notes/2026-11-29-flood.md``)."""


def segments(batch: ForwardBatch, starts: list[int]) -> list[list[int]] | None:
    """The rows of ``batch`` as segments (see the module docstring): each of its ``chunk_rows`` last rows alone,
    the other rows in :func:`width_groups`, each split in :func:`key_groups` (one group with a tree mask); None
    where one grid serves the batch. ``starts``: each row's cached length before the forward."""
    rows, chunks = batch.num_rows, batch.chunk_rows
    lead = list(range(rows - chunks))
    if batch.tree_mask is not None:
        groups = [lead]
    else:
        needed = [start + count for start, count in zip(starts, batch.num_tokens)]
        groups = [keys for group in width_groups(batch.num_tokens, lead) for keys in key_groups(needed, group)]
    parts = [group for group in groups if group] + [[b] for b in range(rows - chunks, rows)]
    return parts if len(parts) > 1 else None


def key_groups(needed: list[int], rows: list[int]) -> list[list[int]]:
    """``rows`` (indices into ``needed``, each row's cache length after the forward, which its grid attends)
    grouped so that the entries their grids attend, ``len(group) x max(needed)`` each, plus
    :data:`SEGMENT_KEYS` per group, are fewest: rows are first put in buckets of :func:`~.grid.wide_bucket`
    lengths (two per octave), and the groups are runs of consecutive buckets (the best runs, found over the
    buckets). Shortest first; ``[rows]`` where one grid is best."""
    if len(rows) < 2:
        return [rows]
    buckets: dict[int, list[int]] = {}
    for b in rows:
        buckets.setdefault(wide_bucket(needed[b]), []).append(b)
    if len(buckets) == 1:
        return [rows]
    runs = [buckets[key] for key in sorted(buckets)]
    longest = [max(needed[b] for b in run) for run in runs]
    # best[j]: the fewest entries for the first j buckets, cut[j]: where its last group starts
    best, cut = [0] * (len(runs) + 1), [0] * (len(runs) + 1)
    for j in range(1, len(runs) + 1):
        count, options = 0, []
        for i in range(j, 0, -1):
            count += len(runs[i - 1])
            options.append((best[i - 1] + count * longest[j - 1] + SEGMENT_KEYS, i - 1))
        best[j], cut[j] = min(options)
    groups, j = [], len(runs)
    while j > 0:
        groups.append([b for run in runs[cut[j]: j] for b in run])
        j = cut[j]
    return groups[::-1]


def width_groups(counts: list[int], rows: list[int]) -> list[list[int]]:
    """``rows`` (indices into ``counts``, each row's tokens) grouped by the width a CPU grid pads them to
    (:func:`~.grid.wide_bucket`: rows of at most :data:`~.grid.WIDE_TOKENS` tokens together); a single group where
    splitting saves at most :data:`SEGMENT_CELLS` cells per extra group."""
    if len(rows) < 2:
        return [rows]
    groups: dict[int, list[int]] = {}
    for b in rows:
        groups.setdefault(wide_bucket(counts[b]), []).append(b)

    def cells(group: list[int]) -> int:
        return len(group) * padded_width(max(counts[b] for b in group))

    if cells(rows) - sum(cells(group) for group in groups.values()) <= SEGMENT_CELLS * (len(groups) - 1):
        return [rows]
    return [groups[width] for width in sorted(groups)]


def sub_batch(batch: ForwardBatch, rows: list[int]) -> tuple[ForwardBatch, list[int]]:
    """The ``rows`` of ``batch`` as a batch of their own (a view of its flat tokens where they are consecutive),
    and the batch's flat token index of each of its tokens."""
    cu = batch.cu_seqlens
    flat = [t for b in rows for t in range(cu[b], cu[b + 1])]
    offsets = list(accumulate((cu[b + 1] - cu[b] for b in rows), initial=0))
    slots = [batch.slots[b] for b in rows]
    if rows == list(range(rows[0], rows[-1] + 1)):
        first, last = cu[rows[0]], cu[rows[-1] + 1]
        return ForwardBatch(batch.input_ids[first:last], batch.positions[first:last], slots, offsets), flat
    index = to_device(flat, batch.input_ids.device)
    return ForwardBatch(batch.input_ids[index], batch.positions[index], slots, offsets), flat


def compute_segments(model: FastLlamaLM, grids: list[Grid], cache: PagedKVPool, hidden_wanted: frozenset[int],
                     layers: tuple[int, ...] | None = None, x: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """:meth:`~.fast_llama.FastLlamaLM.compute` over several grids at once: returns the last layer's output
    ``[C, H]`` (``C`` the cells of every grid, grid after grid) and the hidden states of the
    ``hidden_wanted`` layers, ``[C, H]`` each. ``layers``: the layers run (None: all); ``x`` ``[C, H]``: their
    input (None: the embeddings). No CUDA graph."""
    spec = model.spec
    nh, nkv, hd = model.num_heads, model.num_kv_heads, model.head_dim
    eps, offset, act, det = model.eps, model.offset, spec.activation, model.deterministic
    sizes = [g.rows * g.width for g in grids]
    ropes, views, access = {}, [], []
    run = range(model.num_layers) if layers is None else layers
    for kind in {model.layers[i].rope for i in run}:
        cos, sin = model.rope[kind]
        parts = [(cos[g.write_range[1]: g.write_range[1] + g.width], sin[g.write_range[1]: g.write_range[1] + g.width])
                 if g.write_range is not None else (cos[g.positions].flatten(0, 1), sin[g.positions].flatten(0, 1))
                 for g in grids]
        ropes[kind] = torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])
    for g in grids:
        views.append({window: attention_view(g, window) for window in {model.layers[i].window for i in run}})
        rows_of = None if g.write_range is not None else storage_rows(g, cache.block_size, cache.scratch_row)
        access.append(model._cache_access(g, cache, False, rows_of))
    if x is None:
        x = torch.nn.functional.embedding(torch.cat([g.ids for g in grids]), model.embed)
        if model.embed_scale is not None:
            x = x * model.embed_scale
    x = x[None]  # [1, C, H]
    hidden = {0: x[0]} if 0 in hidden_wanted else {}
    gqa = nkv != nh
    for i in run:
        layer = model.layers[i]
        q, k, v = model._attention_inputs(x, *layer.attention, *ropes[layer.rope], eps, nh, nkv, offset, det)
        outs = []
        for g, q_g, k_g, v_g, (write, read), view in zip(grids, q.split(sizes, 2), k.split(sizes, 2),
                                                         v.split(sizes, 2), access, views):
            q_g = q_g[0].reshape(nh, g.rows, g.width, hd).transpose(0, 1)  # [R, heads, T, head_dim]
            write(cache.keys[i], k_g[0].reshape(nkv, g.rows, g.width, hd).transpose(0, 1))
            write(cache.values[i], v_g[0].reshape(nkv, g.rows, g.width, hd).transpose(0, 1))
            mask, first = view[layer.window]
            keys, values = read(cache.keys[i], 0), read(cache.values[i], 1)
            if first:
                keys, values = keys[:, :, first:], values[:, :, first:]
            pair = g.width == 1 and model.pair_single_queries
            attn = attend(q_g, keys, values, mask, model.scale, gqa, pair, spec.attn_softcap, det)
            outs.append(attn.transpose(0, 1).reshape(nh, g.rows * g.width, hd))
        attn = torch.cat(outs, dim=1)[None]  # [1, heads, C, head_dim]
        if layer.experts is None:
            x = model._attention_output_and_mlp(x, attn, *layer.output, eps, offset, act, det)
        else:
            x, h = model._attention_output(x, attn, *layer.output, eps, offset, det)
            x = x + routed_experts(h, *layer.experts, spec.top_k, spec.norm_topk, spec.float32_route_weights, act, det)
        if i + 1 in hidden_wanted:
            hidden[i + 1] = x[0]
    return x[0], hidden
