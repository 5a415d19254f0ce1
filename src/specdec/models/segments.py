"""One fast forward over rows of very different lengths: a decoding step's rows with prompt chunks fed in
the same forward (chunked prefill fused into the step, :mod:`specdec.scheduler`).

A :class:`~.grid.Grid` computes ``R x T`` cells for ``R`` rows of at most ``T`` tokens, so a 64-token prompt
chunk beside 16 one-token rows would compute 17 x 64 cells for 80 tokens. Here the rows are cut into
*segments*, each laid out as its own grid: the step's rows (pending tokens and drafts) together, then each
prompt chunk (``ForwardBatch.chunk_rows``, the batch's last rows) alone. Every matrix
product of a layer runs once over the cells of all segments, as one flat ``[1, C, H]`` block; only the
cache writes and the attention run per segment, each over its own grid and mask.

Why: on a CPU a small model's forward has a fixed cost per call that a separate prefill forward pays a
second time, and a padded grid pays for its padding. On the embedded pair's target (2 cores, float32, 200
cached tokens; medians, two runs: ``docs/lab-notes/2026-11-28-fused-prefill.md``), one decoding row and a
16-token chunk took 32-35 ms as segments, 39-49 ms apart and 40-42 ms as one padded grid (the row alone: 14-19
ms); 16 rows and a 64-token chunk took 86-94 ms as segments, 99-119 ms apart and 436-466 ms as one grid.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdec.models.base import ForwardBatch
from specdec.models.grid import Grid, attention_view, storage_rows
from specdec.models.kv_pool import PagedKVPool
from specdec.models.layers import attend, routed_experts

if TYPE_CHECKING:
    from specdec.models.fast_llama import FastLlamaLM


def segments(batch: ForwardBatch) -> list[range] | None:
    """The rows of ``batch`` as segments (see the module docstring): its leading rows together, then each of its
    ``chunk_rows`` last rows alone; None when it has no chunk rows, or no other rows (one grid serves it)."""
    rows, chunks = batch.num_rows, batch.chunk_rows
    if not 0 < chunks < rows:
        return None
    return [range(0, rows - chunks), *(range(b, b + 1) for b in range(rows - chunks, rows))]


def sub_batch(batch: ForwardBatch, rows: range) -> ForwardBatch:
    """The consecutive ``rows`` of ``batch`` as a batch of their own (a view of its flat tokens)."""
    cu = batch.cu_seqlens
    first, last = cu[rows.start], cu[rows.stop]
    return ForwardBatch(batch.input_ids[first:last], batch.positions[first:last], batch.slots[rows.start: rows.stop],
                        [c - first for c in cu[rows.start: rows.stop + 1]])


def compute_segments(model: FastLlamaLM, grids: list[Grid], cache: PagedKVPool, hidden_wanted: frozenset[int]
                     ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """:meth:`~.fast_llama.FastLlamaLM.compute` over several grids at once: returns the last layer's output
    ``[C, H]`` (``C`` the cells of every grid, grid after grid) and the hidden states of the
    ``hidden_wanted`` layers, ``[C, H]`` each. Every layer runs (no subsets); no CUDA graph."""
    spec = model.spec
    nh, nkv, hd = model.num_heads, model.num_kv_heads, model.head_dim
    eps, offset, act, det = model.eps, model.offset, spec.activation, model.deterministic
    sizes = [g.rows * g.width for g in grids]
    ropes, views, access = {}, [], []
    for kind in {layer.rope for layer in model.layers}:
        cos, sin = model.rope[kind]
        parts = [(cos[g.write_range[1]: g.write_range[1] + g.width], sin[g.write_range[1]: g.write_range[1] + g.width])
                 if g.write_range is not None else (cos[g.positions].flatten(0, 1), sin[g.positions].flatten(0, 1))
                 for g in grids]
        ropes[kind] = torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])
    for g in grids:
        views.append({window: attention_view(g, window) for window in {layer.window for layer in model.layers}})
        rows_of = None if g.write_range is not None else storage_rows(g, cache.block_size, cache.scratch_row)
        access.append(model._cache_access(g, cache, False, rows_of))
    x = torch.nn.functional.embedding(torch.cat([g.ids for g in grids]), model.embed)[None]  # [1, C, H]
    if model.embed_scale is not None:
        x = x * model.embed_scale
    hidden = {0: x[0]} if 0 in hidden_wanted else {}
    gqa = nkv != nh
    for i, layer in enumerate(model.layers):
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
