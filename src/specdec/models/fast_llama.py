"""The fast backend: one decoder for every family of :mod:`.families` (Llama, Qwen2/3, Mistral, Phi-3,
Gemma 2/3, Qwen3-MoE, Mixtral).

It reads the weights of a loaded transformers model through the family's weight map (:mod:`.fast_weights`: no
forked modeling file, no copy of the weights beyond fusing split q/k/v and gate/up projections) and runs
the same arithmetic as transformers' eager forward (:mod:`.layers`) with far fewer Python calls per
layer, over a preallocated :class:`~.kv_pool.PagedKVPool`: rollback moves a slot's length (and frees
the blocks past it).

The ragged batch of :class:`~specdec.models.base.ForwardBatch` is laid out as a padded
``[R, T]`` :class:`~.grid.Grid` (``T`` the longest row) for the matrix work. On CUDA, chain forwards
of up to 16 tokens per row replay captured graphs (:mod:`.cuda_graphs`) unless the model was loaded
with ``enforce_eager``; attention always spans a bucketed cache length with a mask, so its cost and
plan do not follow every new length (a windowed layer too: its window is a mask over that span).
On a CPU, a bfloat16 forward of one token per row attends each query as a pair
(:data:`PAIR_SINGLE_QUERIES`). ``deterministic`` (CPU only) computes every row with the batch-invariant
products and attention of :mod:`.deterministic`, over key lengths padded to its key blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specdec.argmax import argmax
from specdec.errors import SpecDecError
from specdec.models.base import CausalLM, ForwardBatch, ForwardOutput, check_pool_fits, to_device
from specdec.models.cpu_linear import linear, pack, packed_copy
from specdec.models.cuda_graphs import GraphSet, graph_shape, replay, replay_greedy_chain
from specdec.models.deterministic import pad_keys, rows_linear
from specdec.models.families import decoder_spec, unsupported_reason
from specdec.models.fast_weights import norm_weight, plain, read_layer
from specdec.models.grid import (
    WIDE_TOKENS,
    Grid,
    attention_view,
    on_cells,
    padded_width,
    read_rows,
    storage_rows,
    tree_bits,
    tree_mask,
    wide_bucket,
    write_rows,
)
from specdec.models.hf import context_window
from specdec.models.kv_pool import BLOCK_SIZE, PagedKVPool
from specdec.models.layers import (
    attend,
    attention_inputs,
    attention_output,
    attention_output_and_mlp,
    decoder_layer,
    dense_experts,
    rms_norm,
    routed_experts,
)
from specdec.models.prefix_cache import PrefixCache
from specdec.models.segments import compute_segments, segments, sub_batch

__all__ = ["FastLlamaLM", "unsupported_reason"]

PAIR_SINGLE_QUERIES = (torch.bfloat16,)
"""Model dtypes whose one-token-per-row attention a CPU computes for two copies of each query. torch's CPU
flash attention takes a slow path for a single query in bfloat16: measured on the 2-core machine
(torch 2.13, 16 rows, 8 heads of 64, 201 cached keys) 1.17 ms against 0.47 ms for the same query twice,
and 2.6-4x slower at every shape tried; in float32 and float64 one query is the faster, in float16 both
are as slow. So a plain decoding step, and a draft model's every step, attend a query pair there."""


class FastLlamaLM(CausalLM):
    """Batched static-pool forward of a decoder of any family of :mod:`.families`."""

    supports_tree_mask = True
    supports_layer_subsets = True
    pads_rows = True

    @property
    def fuses_prefill(self) -> bool:
        """Prompt chunks share the decoding step's forward (:mod:`.segments`): on a CPU, where a forward's
        fixed cost is a large share of a step, outside the deterministic mode (its grids are per row)."""
        return self.device.type == "cpu" and not self.deterministic

    def __init__(self, model: PreTrainedModel, name: str, use_cuda_graphs: bool = False,
                 pack_weights: bool = True, deterministic: bool = False, fuse_layers: bool = True,
                 packed_head: torch.Tensor | None = None, consume: bool = False) -> None:
        if deterministic and model.device.type != "cpu":
            raise SpecDecError(
                f"deterministic mode runs on a CPU only (its batch-invariant kernels are not written for "
                f"{model.device.type}); load {name!r} with device='cpu' or without deterministic")
        self.deterministic = deterministic
        config = model.config
        self.config = config
        self.name = name
        self.device = model.device
        self.dtype = model.dtype
        self.max_length = context_window(config)
        self.use_cuda_graphs = use_cuda_graphs and self.device.type == "cuda"
        self.pair_single_queries = self.device.type == "cpu" and self.dtype in PAIR_SINGLE_QUERIES
        spec = self.spec = decoder_spec(config)
        # Under CUDA graphs the element-wise work between the matrix products is fused by
        # torch.compile (one compile per function, dynamic shapes): a few kernels per layer
        # instead of about thirty, which is what a small model's graph replay is made of.
        self._attention_inputs, self._attention_output_and_mlp = attention_inputs, attention_output_and_mlp
        self._attention_output, self._dense_experts = attention_output, dense_experts
        # A captured forward's dense layers run compiled whole while ``fuse_layers`` (read at capture): the
        # cache write and gather and the attention inside the compiled function too, so fewer kernels per
        # layer; off, the pieces around the attention are compiled apart (kept for comparisons).
        self.fuse_layers = fuse_layers
        self._decoder_layer = None
        if self.use_cuda_graphs:
            # One compiled function serves every model of the process (a draft and its target
            # differ in width): allow a recompile per model and dtype.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            compiled = [torch.compile(f, dynamic=True, fullgraph=True)
                        for f in (attention_inputs, attention_output_and_mlp, attention_output, dense_experts)]
            (self._attention_inputs, self._attention_output_and_mlp, self._attention_output,
             self._dense_experts) = compiled
            self._decoder_layer = torch.compile(decoder_layer, dynamic=True, fullgraph=True)
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.eps, self.scale, self.offset = spec.eps, spec.scale, spec.family.norm_offset
        base = model.model
        self.embed = base.embed_tokens.weight
        # Gemma scales the embeddings by sqrt(hidden) rounded to float32, then to the model dtype.
        self.embed_scale = (torch.tensor(config.hidden_size**0.5).to(device=self.device, dtype=self.dtype)
                            if spec.family.embed_scale else None)
        self.final_norm = norm_weight(base.norm.weight, self.offset)
        self.lm_head = model.lm_head.weight
        # What head() reads on a CPU: ``packed_head`` where the caller has one for this head (an EAGLE layer
        # scores with its target's), else a copy of its own.
        if packed_head is None and pack_weights:
            packed_head = packed_copy(self.lm_head)
        self.packed_head = packed_head
        self.vocab_size = self.lm_head.shape[0]
        # The decoder layers' dense matrices, packed for the CPU's matrix products where that pays
        # (:mod:`.cpu_linear`; ``pack_weights=False`` keeps them plain, for comparisons).
        packed = pack if pack_weights else plain
        # ``consume`` (a model loaded for this backend alone): each transformers layer is dropped from the model
        # once read, so that its split and unpacked weights are freed before the next layer's copies are made and
        # loading peaks at about one model's size, not two (a tensor the backend reads as it is stays alive).
        self.layers = []
        for i in range(len(base.layers)):
            self.layers.append(read_layer(base.layers[i], spec, i, packed))
            if consume:
                base.layers[i] = torch.nn.Identity()
        self.num_layers = len(self.layers)
        # cos/sin for every position, computed once by the model's own rotary module (per layer type
        # where the family's rotary differs by layer type).
        self.rope = {}
        with torch.no_grad():
            positions = torch.arange(self.max_length, device=self.device)[None]
            probe = torch.empty(0, device=self.device, dtype=self.dtype)
            for kind in sorted({layer.rope for layer in self.layers}, key=str):
                cos, sin = base.rotary_emb(probe, positions, *([] if kind is None else [kind]))
                # rotate_half(x) * sin == x.roll(half) * [-sin_lo, sin_hi]: one roll instead of slices and a cat.
                half = cos.shape[-1] // 2
                self.rope[kind] = (cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1))

    def kv_bytes_per_token(self) -> int:
        return 2 * len(self.layers) * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def step_weight_bytes(self) -> int:
        tensors = [t for layer in self.layers for part in (layer.attention, layer.output, layer.experts or ())
                   for t in part if isinstance(t, torch.Tensor)]
        head = self.lm_head if self.packed_head is None else self.packed_head
        row = self.embed[0].numel() * self.embed.element_size()
        return row + sum(t.numel() * t.element_size() for t in [*tensors, head])

    def new_cache(self, num_slots: int, capacity: int, num_blocks: int | None = None,
                  prefix_caching: bool = False) -> PagedKVPool:
        size, tokens = BLOCK_SIZE, None if num_blocks is None else num_blocks * BLOCK_SIZE
        if num_blocks is None:
            num_blocks = num_slots * -(-capacity // size)
        # One scratch row past the blocks takes the writes of padding cells.
        shape = (num_blocks * size + 1, self.num_kv_heads, self.head_dim)
        check_pool_fits(2 * len(self.layers) * math.prod(shape) * self.dtype.itemsize, num_slots, capacity,
                        self.device, self.name, tokens)

        def zeros() -> list[torch.Tensor]:
            return [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.layers]

        return PagedKVPool(num_slots, capacity, size, num_blocks, keys=zeros(), values=zeros(),
                           prefix=PrefixCache() if prefix_caching else None)

    def key_bucket(self, needed: int, capacity: int, wide: bool = False) -> int:
        """Attended cache length. On CUDA a power of two >= 256, so that a few shapes (and captured
        graphs, and attention plans) serve every length; on a CPU, for a ``wide`` forward (a prefill),
        :func:`wide_bucket`, since the CPU kernels keep state per shape (see :data:`WIDE_TOKENS`);
        else exactly ``needed``. Capped at ``capacity``."""
        if self.device.type == "cuda":
            return min(capacity, max(256, 1 << (needed - 1).bit_length()))
        if self.deterministic:  # whole key blocks (a length past ``capacity`` is padded in the attention)
            return min(capacity, pad_keys(wide_bucket(needed) if wide else needed))
        return min(capacity, wide_bucket(needed)) if wide else needed

    def grid(self, batch: ForwardBatch, cache: PagedKVPool) -> tuple[Grid, torch.Tensor | None]:
        """Lay a ragged batch out as a :class:`Grid` (rows = the batch's rows); also returns the
        grid cell of every flat token, ``[N]`` (None when they coincide: a single chain row)."""
        device, counts, slots = self.device, batch.num_tokens, batch.slots
        starts = [cache.lengths[s] for s in slots]
        rows, width = len(counts), max(counts)
        chain = batch.tree_mask is None
        wide = chain and width > WIDE_TOKENS and self.device.type == "cpu"
        if rows == 1 and chain and not wide and not self.use_cuda_graphs:
            g = self._single_row_grid(batch, starts[0], cache)
            if g is not None:
                return g, None
        if wide:  # padded to one of a few widths (padding cells write to the scratch row)
            width = padded_width(width)
        cells = [b * width + t for b, c in enumerate(counts) for t in range(c)]
        write_index = [start + t if t < c else -1 for start, c in zip(starts, counts) for t in range(width)]
        needed = max(s + c for s, c in zip(starts, counts))
        key_len = self.key_bucket(needed, cache.capacity, wide)
        nb = cache.blocks_for(key_len)
        table = [(t[:nb] + [0] * (nb - len(t)))[:nb] for t in (cache.tables[s] for s in slots)]
        host = to_device(write_index + cells + starts + [b for t in table for b in t], device)  # one copy
        n, cells_at = len(cells), rows * width
        cell_index = host[cells_at : cells_at + n]
        starts_t, table_t = host[cells_at + n : cells_at + n + rows], host[cells_at + n + rows :].view(rows, nb)
        dense = n == rows * width
        ids, positions = batch.input_ids, batch.positions
        if not dense:
            ids = ids.new_zeros(rows * width).index_copy_(0, cell_index, ids)
            positions = positions.new_zeros(rows * width).index_copy_(0, cell_index, positions)
        single = rows == 1 and width == 1 and batch.tree_mask is None
        g = Grid(rows, width, key_len, ids, positions.view(rows, width), host[:cells_at], starts_t, table_t,
                 needs_mask=not (single and key_len == needed))
        if batch.tree_mask is not None:
            g.mask, g.key_positions = tree_mask(tree_bits(batch.tree_mask, cell_index, rows, width), g)
        return g, cell_index

    def _single_row_grid(self, batch: ForwardBatch, start: int, cache: PagedKVPool) -> Grid | None:
        """The one-row chain case of :meth:`grid` (every batch-1 step) without index tensors when the
        slot's blocks are consecutive (else None): writes and reads are slices, and the cells are the
        flat tokens themselves (``cell_index`` None)."""
        width, slot = batch.num_tokens[0], batch.slots[0]
        needed = start + width
        key_len = self.key_bucket(needed, cache.capacity)
        row = cache.consecutive_rows(slot, key_len)
        if row is None:
            return None
        return Grid(1, width, key_len, batch.input_ids, batch.positions.view(1, width), None, None, None,
                    needs_mask=not (width == 1 and key_len == needed), write_range=(row, start))

    @staticmethod
    def _cache_access(g: Grid, cache: PagedKVPool, capturable: bool,
                      rows_of: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[Callable, Callable]:
        """``write(pool, new)`` of new keys or values ``[R, kv_heads, T, head_dim]`` into their cells,
        and ``read(pool, which)``: the attended cache of the grid's rows, ``[R, kv_heads, K, head_dim]``
        (a view of token-major rows; ``which``: 0 for keys, 1 for values, whose gathered copies must
        not share a buffer). Chosen once per forward: slices where one row's blocks are consecutive
        (cheapest on a CPU), else through the block table (``rows_of``: the grid's :func:`storage_rows`; on a
        CPU into :meth:`PagedKVPool.gather_buffers`)."""
        rows, width, key_len = g.rows, g.width, g.key_len
        if g.write_range is not None:
            first, start = g.write_range

            def write(pool: torch.Tensor, new: torch.Tensor) -> None:
                pool[first + start : first + start + width] = new[0].transpose(0, 1)

            def read(pool: torch.Tensor, which: int) -> torch.Tensor:
                return pool[first : first + key_len].transpose(0, 1)[None]

            return write, read
        written, attended = rows_of

        def write(pool: torch.Tensor, new: torch.Tensor) -> None:
            write_rows(pool, written, new)

        # On CUDA the caching allocator reuses the copies' memory (and graphs capture it).
        buffers = cache.gather_buffers(rows, key_len) if cache.keys[0].device.type == "cpu" and not capturable else None

        def read(pool: torch.Tensor, which: int) -> torch.Tensor:
            return read_rows(pool, attended, rows, None if buffers is None else buffers[which])

        return write, read

    def compute(self, g: Grid, cache: PagedKVPool, hidden_wanted: frozenset[int] = frozenset(),
                layers: tuple[int, ...] | None = None, x: torch.Tensor | None = None, capturable: bool = False
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The layers over a grid: writes keys and values, returns the last layer's output
        ``[R*T, H]`` (before the final norm) and the hidden states of ``hidden_wanted`` layers.
        ``layers``: the layers run (None: all); ``x`` ``[R, T, H]``: their input (None: the embeddings).
        Pure device work with static shapes for a given (R, T, K), except routed experts, which read
        their tokens' choices on the host: ``capturable`` (a CUDA graph's body) computes them in
        :func:`~.layers.dense_experts`' form instead, with no host sync."""
        rows, width = g.rows, g.width
        spec = self.spec
        nh, nkv, eps, offset, act = self.num_heads, self.num_kv_heads, self.eps, self.offset, spec.activation
        run = range(self.num_layers) if layers is None else layers
        ropes = {}
        for kind in {self.layers[i].rope for i in run}:
            cos, sin = self.rope[kind]
            if g.write_range is not None and g.mask is None:  # one chain row: positions are start, start+1, ...
                start = g.write_range[1]
                ropes[kind] = cos[start : start + width], sin[start : start + width]
            else:
                ropes[kind] = cos[g.positions][:, None], sin[g.positions][:, None]
        views = {window: attention_view(g, window) for window in {self.layers[i].window for i in run}}
        if x is None:
            x = F.embedding(g.ids, self.embed).view(rows, width, -1)
            if self.embed_scale is not None:
                x = x * self.embed_scale
        hidden = {0: x} if 0 in hidden_wanted else {}
        rows_of = None if g.write_range is not None else storage_rows(g, cache.block_size, cache.scratch_row)
        write, read = self._cache_access(g, cache, capturable, rows_of)
        gqa = nkv != nh
        pair = width == 1 and self.pair_single_queries
        det = self.deterministic
        fused = self._decoder_layer if capturable and self.fuse_layers and rows_of is not None else None
        for i in run:
            layer = self.layers[i]
            if fused is not None and layer.experts is None:
                x = fused(x, layer.attention, layer.output, *ropes[layer.rope], cache.keys[i], cache.values[i],
                          *rows_of, views[layer.window][0], eps, nh, nkv, gqa, offset, self.scale, spec.attn_softcap,
                          act)
                if i + 1 in hidden_wanted:
                    hidden[i + 1] = x
                continue
            q, k, v = self._attention_inputs(x, *layer.attention, *ropes[layer.rope], eps, nh, nkv, offset, det)
            keys, values = cache.keys[i], cache.values[i]
            write(keys, k)
            write(values, v)
            mask, first = views[layer.window]
            keys, values = read(keys, 0), read(values, 1)
            if first:  # a single query's window: only its entries are read
                keys, values = keys[:, :, first:], values[:, :, first:]
            attn = attend(q, keys, values, mask, self.scale, gqa, pair, spec.attn_softcap, det)
            if layer.experts is None:
                x = self._attention_output_and_mlp(x, attn, *layer.output, eps, offset, act, det)
            else:
                x, h = self._attention_output(x, attn, *layer.output, eps, offset, det)
                if capturable:
                    x = x + self._dense_experts(h, *layer.experts, spec.top_k, spec.norm_topk,
                                                spec.float32_route_weights, act)
                else:
                    x = x + routed_experts(h, *layer.experts, spec.top_k, spec.norm_topk,
                                           spec.float32_route_weights, act, det)
            if i + 1 in hidden_wanted:
                hidden[i + 1] = x
        return x.view(rows * width, -1), hidden

    def states(self, x: torch.Tensor, hidden: dict[int, torch.Tensor], layers: Sequence[int],
               cells: torch.Tensor | slice) -> torch.Tensor:
        """The hidden states ``[M, len(layers), H]`` of grid ``cells`` (``[M]`` or a slice) for
        transformers' ``hidden_states`` indices ``layers`` (non-negative; ``num_layers`` is the final,
        normed one): ``x`` ``[R*T, H]`` is the last layer's output and ``hidden`` the inner layers' of
        :meth:`compute`."""
        final, width = self.num_layers, x.shape[-1]
        return torch.stack([self.final_hidden(x[cells]) if i == final else hidden[i].reshape(-1, width)[cells]
                            for i in layers], dim=1)

    def final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm of the last layer's output ``[M, H]``."""
        return rms_norm(x, self.final_norm, self.eps, self.offset)

    def head(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm and output head: ``[M, H]`` -> logits ``[M, V]`` (``[M, V']`` scored with ``rows``
        ``[V', H]`` of the head instead of all of it), soft-capped where the family caps its logits."""
        weight = rows if rows is not None else self.lm_head if self.packed_head is None else self.packed_head
        x = self.final_hidden(x)
        logits = rows_linear(linear, x, weight) if self.deterministic else linear(x, weight)
        cap = self.spec.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @torch.inference_mode()
    def greedy_chain(self, tokens: torch.Tensor, slots: list[int], cache: PagedKVPool, steps: int,
                     output_head: torch.Tensor | None = None, token_ids: torch.Tensor | None = None,
                     features: torch.Tensor | None = None, inputs: Callable | None = None) -> torch.Tensor:
        fits = all(cache.lengths[s] + steps <= cache.capacity for s in slots)
        if fits:
            for s in slots:
                cache.reserve(s, cache.lengths[s] + steps)
        if (self.device.type == "cpu" and fits and len(slots) == 1 and inputs is None
                and cache.consecutive_rows(slots[0], cache.lengths[slots[0]] + steps) is not None):
            return self._one_row_chain(tokens, slots[0], cache, steps, output_head, token_ids)
        if not (self.use_cuda_graphs and fits):
            return super().greedy_chain(tokens, slots, cache, steps, output_head, token_ids, features, inputs)
        if cache.graphs is None:
            cache.graphs = GraphSet.allocate(cache, self.device)
        return replay_greedy_chain(self, tokens, slots, cache, steps, output_head, token_ids, features, inputs)

    def _one_row_chain(self, token: torch.Tensor, slot: int, cache: PagedKVPool, steps: int,
                       output_head: torch.Tensor | None, token_ids: torch.Tensor | None) -> torch.Tensor:
        """:meth:`greedy_chain` for one row without graphs (a batch-1 draft on a CPU): each step is
        the grid of :meth:`_single_row_grid` built in place, with no batch, positions tensor or
        output object, since per-call Python is most of a small draft's step there. ``[1, steps]``."""
        start, row = cache.lengths[slot], cache.consecutive_rows(slot, cache.lengths[slot] + steps)
        out = []
        for i in range(steps):
            g = Grid(1, 1, start + i + 1, token, None, None, None, None, needs_mask=False, write_range=(row, start + i))
            token = argmax(self.head(self.compute(g, cache)[0], output_head))
            if token_ids is not None:
                token = token_ids[token]
            out.append(token)
        cache.lengths[slot] += steps
        return torch.stack(out, dim=1)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: PagedKVPool) -> ForwardOutput:
        self.check_fits(batch, cache)
        for slot, count in zip(batch.slots, batch.num_tokens):
            cache.reserve(slot, cache.lengths[slot] + count)
        shape = graph_shape(self, batch, cache) if self.use_cuda_graphs else None
        if shape is not None:
            if cache.graphs is None:
                cache.graphs = GraphSet.allocate(cache, self.device)
            logits, states, cell_index = replay(self, batch, cache, shape)
            for slot, count in zip(batch.slots, batch.num_tokens):
                cache.lengths[slot] += count
            wanted = cell_index if batch.logits_rows is None else cell_index[batch.logits_rows]
            return ForwardOutput(logits[wanted], None if states is None else states[wanted])
        final = len(self.layers)
        wanted_layers = [i if i >= 0 else final + 1 + i for i in batch.hidden_layers]
        inner = frozenset(i for i in wanted_layers if i < final)
        parts = segments(batch, [cache.lengths[s] for s in batch.slots]) if self.fuses_prefill else None
        if parts is not None:  # rows of very different lengths (prompt chunks among them): a grid each
            grids, cells, order, offset = [], [], [], 0
            for rows in parts:
                sub, flat = sub_batch(batch, rows)
                g, index = self.grid(sub, cache)
                cells.append(index + offset if index is not None else
                             torch.arange(offset, offset + len(flat), device=self.device))
                grids.append(g)
                order += flat
                offset += g.rows * g.width
            cell_index = torch.cat(cells)
            if order != list(range(len(order))):  # the flat tokens' cells, in the batch's order
                cell_index = torch.empty_like(cell_index).index_copy_(0, to_device(order, self.device), cell_index)
            x = on_cells(batch.input_hidden, cell_index, offset)
            x, hidden = compute_segments(self, grids, cache, inner, batch.layers, x)
        else:
            g, cell_index = self.grid(batch, cache)
            x = on_cells(batch.input_hidden, cell_index, g.rows * g.width)
            if x is not None:
                x = x.view(g.rows, g.width, -1)
            x, hidden = self.compute(g, cache, inner, batch.layers, x)
        for slot, count in zip(batch.slots, batch.num_tokens):
            cache.lengths[slot] += count
        # Grid cells of the wanted flat rows (a single row's cells are its flat tokens).
        if cell_index is None:
            wanted = slice(None) if batch.logits_rows is None else batch.logits_rows
            kept = wanted if batch.hidden_rows is None else batch.hidden_rows
        else:
            wanted = cell_index if batch.logits_rows is None else cell_index[batch.logits_rows]
            kept = wanted if batch.hidden_rows is None else cell_index[batch.hidden_rows]
        last = x[wanted]
        if last.shape[0] == 0 and batch.hidden_rows is None:
            return ForwardOutput(x.new_empty(0, self.vocab_size))
        out_hidden = self.states(x, hidden, wanted_layers, kept) if wanted_layers else None
        if batch.exit_adapter is not None:
            last = batch.exit_adapter(last)
        return ForwardOutput(self.head(last, batch.output_head), out_hidden)
