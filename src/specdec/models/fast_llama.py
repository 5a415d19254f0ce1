"""A fast backend for the Llama family (Llama, Qwen2, Mistral without a sliding window).

It reads the weights of a loaded transformers model (no forked modeling file, no copy of
the weights beyond fusing q/k/v and gate/up projections) and runs the same arithmetic as
transformers' eager forward with far fewer Python calls per layer, over a preallocated
:class:`StaticKVPool`: rollback only moves a slot's length, as in gpt-fast.

The ragged batch of :class:`~specdec.models.base.ForwardBatch` is laid out as a padded
``[R, T]`` :class:`Grid` (``T`` the longest row) for the matrix work; padding cells are
computed but write only to a scratch column of the cache and are never returned. On CUDA,
chain forwards of up to 16 tokens per row replay captured graphs (:mod:`.cuda_graphs`)
unless the model was loaded with ``enforce_eager``; attention always spans a bucketed cache
length with a mask, so its cost and plan do not follow every new length. On a CPU, a bfloat16
forward of one token per row attends each query as a pair (:data:`PAIR_SINGLE_QUERIES`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specdec.argmax import argmax
from specdec.models.base import CausalLM, ForwardBatch, ForwardOutput, KVCache, to_device
from specdec.models.cpu_linear import linear, pack
from specdec.models.cuda_graphs import GraphSet, graph_shape, replay, replay_greedy_chain
from specdec.models.hf import context_window

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


def unsupported_reason(config) -> str | None:
    """Why the fast backend cannot run this config, or None if it can."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not silu"
    if getattr(config, "use_sliding_window", False) or getattr(config, "sliding_window", None):
        return "sliding-window attention is not supported"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") in ("dynamic", "longrope"):
        return f"rope type {rope['rope_type']!r} depends on the sequence length"
    return None


WIDE_TOKENS = 16
"""On a CPU, a chain forward whose longest row feeds more than this many tokens (a prefill) is
padded to :func:`wide_bucket` tokens per row, and attends to a bucketed cache length: oneDNN's
half-precision matrix and attention kernels keep state for every shape they see (about 0.5 MB
each), so exact prompt lengths would grow resident memory with every new length."""


PAIR_SINGLE_QUERIES = (torch.bfloat16,)
"""Model dtypes whose one-token-per-row attention a CPU computes for two copies of each query. torch's CPU
flash attention takes a slow path for a single query in bfloat16: measured on the 2-core machine
(torch 2.13, 16 rows, 8 heads of 64, 201 cached keys) 1.17 ms against 0.47 ms for the same query twice,
and 2.6-4x slower at every shape tried; in float32 and float64 one query is the faster, in float16 both
are as slow. So a plain decoding step, and a draft model's every step, attend a query pair there."""


def wide_bucket(n: int) -> int:
    """The smallest of 16, 24, 32, 48, 64, 96, ... (two per octave) that is >= ``n``."""
    if n <= WIDE_TOKENS:
        return WIDE_TOKENS
    power = 1 << (n - 1).bit_length()
    return power * 3 // 4 if power * 3 // 4 >= n else power


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's arithmetic: statistics in float32, then the weight in the model dtype. (The
    layer functions call torch's operators directly, not their Python wrappers in
    ``torch.nn.functional``/``Tensor``: on a CPU a small model's step is bound by per-call cost.)"""
    if x.dtype == torch.float32:
        return torch.rms_norm(x, weight.shape, weight, eps)
    return weight * torch.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def attention_inputs(
    x: torch.Tensor, norm: torch.Tensor, qkv_weight: torch.Tensor, qkv_bias: torch.Tensor | None,
    cos: torch.Tensor, sin: torch.Tensor, eps: float, num_heads: int, num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm, fused q/k/v projection and rotary embedding of ``x`` ``[R, T, H]``: returns ``q``
    ``[R, heads, T, head_dim]`` and the new keys and values ``[R, kv_heads, T, head_dim]``."""
    rows, width = x.shape[:2]
    head_dim = cos.shape[-1]
    qkv = linear(rms_norm(x, norm, eps), qkv_weight, qkv_bias)
    qk, v = qkv.view(rows, width, num_heads + 2 * num_kv_heads, head_dim).transpose(1, 2).split_with_sizes(
        (num_heads + num_kv_heads, num_kv_heads), dim=1)
    # rotate_half(x) * sin == x.roll(half) * [-sin_lo, sin_hi]
    qk = qk * cos + qk.roll(head_dim // 2, dims=-1) * sin
    q, k = qk.split_with_sizes((num_heads, num_kv_heads), dim=1)
    return q, k, v


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float,
           gqa: bool, pair: bool) -> torch.Tensor:
    """Scaled dot-product attention of ``q`` ``[R, heads, T, head_dim]`` over ``keys`` and ``values``
    ``[R, kv_heads, K, head_dim]`` (``mask`` ``[R, 1, T, K]`` or None). ``pair`` (``T = 1`` only): the
    query is attended as two copies of itself and the first answer kept, see :data:`PAIR_SINGLE_QUERIES`."""
    if pair:
        q = torch.cat([q, q], dim=2)
        mask = None if mask is None else mask.expand(-1, -1, 2, -1)
    attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return attn[:, :, :1] if pair else attn


def attention_output_and_mlp(
    x: torch.Tensor, attn: torch.Tensor, o_weight: torch.Tensor, o_bias: torch.Tensor | None, norm: torch.Tensor,
    gate_up_weight: torch.Tensor, gate_up_bias: torch.Tensor | None, down_weight: torch.Tensor,
    down_bias: torch.Tensor | None, eps: float,
) -> torch.Tensor:
    """The rest of a decoder layer: output projection and residual, norm, SwiGLU MLP and residual.
    ``x`` ``[R, T, H]``, ``attn`` ``[R, heads, T, head_dim]``."""
    rows, width = x.shape[:2]
    x = x + linear(attn.transpose(1, 2).reshape(rows, width, -1), o_weight, o_bias)
    gate, up = linear(rms_norm(x, norm, eps), gate_up_weight, gate_up_bias).chunk(2, -1)
    return x + linear(F.silu(gate) * up, down_weight, down_bias)


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_weight: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None


def _cat_bias(*modules: torch.nn.Linear) -> torch.Tensor | None:
    if all(m.bias is None for m in modules):
        return None
    return torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in modules])


def _plain(weight: torch.Tensor) -> torch.Tensor:
    return weight


@dataclass
class Grid:
    """The padded ``[R, T]`` grid one forward computes, as device tensors.

    ``ids`` ``[R*T]`` (padding cells hold token 0), ``positions`` ``[R, T]``, ``write_slot`` and
    ``write_index`` ``[R*T]``: the cache cell of each grid cell (padding cells write to their
    slot's scratch column, index ``capacity``, which is never attended), ``starts`` ``[R]``: the
    cached length of each row before the forward (None with ``write_range``, which holds it).
    ``key_len`` ``K``: cache entries attended to; ``mask`` ``[R, 1, T, K]`` or None (then the
    causal chain mask is derived from ``starts``; with ``R = T = 1`` and ``K`` exact no mask is
    needed). ``first_slot``: rows are slots ``first_slot .. first_slot+R-1`` (the pool is sliced),
    or None (gathered by ``slots`` ``[R]``). ``write_range``: ``(slot, start)`` when one row writes
    all its cells to consecutive entries (a plain slice assignment, cheaper on a CPU than the
    indexed write; ``write_slot`` and ``write_index`` are then None), else None.
    """

    rows: int
    width: int
    key_len: int
    ids: torch.Tensor
    positions: torch.Tensor
    write_slot: torch.Tensor | None
    write_index: torch.Tensor | None
    starts: torch.Tensor | None
    slots: torch.Tensor | None
    first_slot: int | None
    mask: torch.Tensor | None = None
    needs_mask: bool = True
    write_range: tuple[int, int] | None = None


class FastLlamaLM(CausalLM):
    """Batched static-pool forward for ``LlamaForCausalLM``-shaped weights."""

    supports_tree_mask = True
    supports_layer_subsets = True
    pads_rows = True

    def __init__(self, model: PreTrainedModel, name: str, use_cuda_graphs: bool = False,
                 pack_weights: bool = True) -> None:
        config = model.config
        self.config = config
        self.name = name
        self.device = model.device
        self.dtype = model.dtype
        self.max_length = context_window(config)
        self.use_cuda_graphs = use_cuda_graphs and self.device.type == "cuda"
        self.pair_single_queries = self.device.type == "cpu" and self.dtype in PAIR_SINGLE_QUERIES
        # Under CUDA graphs the element-wise work between the matrix products is fused by
        # torch.compile (one compile per function, dynamic shapes): a few kernels per layer
        # instead of about thirty, which is what a small model's graph replay is made of.
        self._attention_inputs, self._attention_output_and_mlp = attention_inputs, attention_output_and_mlp
        if self.use_cuda_graphs:
            # One compiled function serves every model of the process (a draft and its target
            # differ in width): allow a recompile per model and dtype.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self._attention_inputs = torch.compile(attention_inputs, dynamic=True, fullgraph=True)
            self._attention_output_and_mlp = torch.compile(attention_output_and_mlp, dynamic=True, fullgraph=True)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        base = model.model
        self.embed = base.embed_tokens.weight
        self.final_norm = base.norm.weight
        self.lm_head = model.lm_head.weight
        self.vocab_size = self.lm_head.shape[0]
        # The decoder layers' weights, packed for the CPU's matrix products where that pays
        # (:mod:`.cpu_linear`; ``pack_weights=False`` keeps them plain, for comparisons).
        packed = pack if pack_weights else _plain
        self.layers = []
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    input_norm=layer.input_layernorm.weight,
                    qkv_weight=packed(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])),
                    qkv_bias=_cat_bias(attn.q_proj, attn.k_proj, attn.v_proj),
                    o_weight=packed(attn.o_proj.weight),
                    o_bias=attn.o_proj.bias,
                    post_norm=layer.post_attention_layernorm.weight,
                    gate_up_weight=packed(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                    gate_up_bias=_cat_bias(mlp.gate_proj, mlp.up_proj),
                    down_weight=packed(mlp.down_proj.weight),
                    down_bias=mlp.down_proj.bias,
                )
            )
        self.num_layers = len(self.layers)
        # Each layer's tensors in the argument order of the two per-layer functions.
        self._layer_args = [
            ((layer.input_norm, layer.qkv_weight, layer.qkv_bias),
             (layer.o_weight, layer.o_bias, layer.post_norm, layer.gate_up_weight, layer.gate_up_bias,
              layer.down_weight, layer.down_bias))
            for layer in self.layers
        ]
        # cos/sin for every position, computed once by the model's own rotary module.
        with torch.no_grad():
            positions = torch.arange(self.max_length, device=self.device)[None]
            probe = torch.empty(0, device=self.device, dtype=self.dtype)
            cos, sin = base.rotary_emb(probe, positions)
        # rotate_half(x) * sin == x.roll(half) * [-sin_lo, sin_hi]: one roll instead of slices and a cat.
        half = self.head_dim // 2
        self.cos = cos[0]
        self.sin_signed = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)

    def new_cache(self, num_slots: int, capacity: int) -> StaticKVPool:
        # One scratch column past ``capacity`` takes the writes of padding cells.
        shape = (num_slots, self.num_kv_heads, capacity + 1, self.head_dim)

        def zeros() -> list[torch.Tensor]:
            return [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.layers]

        return StaticKVPool(num_slots, capacity, keys=zeros(), values=zeros())

    def key_bucket(self, needed: int, capacity: int, wide: bool = False) -> int:
        """Attended cache length. On CUDA a power of two >= 256, so that a few shapes (and captured
        graphs, and attention plans) serve every length; on a CPU, for a ``wide`` forward (a prefill),
        :func:`wide_bucket`, since the CPU kernels keep state per shape (see :data:`WIDE_TOKENS`);
        else exactly ``needed``. Capped at ``capacity``."""
        if self.device.type == "cuda":
            return min(capacity, max(256, 1 << (needed - 1).bit_length()))
        return min(capacity, wide_bucket(needed)) if wide else needed

    def grid(self, batch: ForwardBatch, cache: StaticKVPool) -> tuple[Grid, torch.Tensor | None]:
        """Lay a ragged batch out as a :class:`Grid` (rows = the batch's rows); also returns the
        grid cell of every flat token, ``[N]`` (None when they coincide: a single chain row)."""
        device, counts, slots = self.device, batch.num_tokens, batch.slots
        starts = [cache.lengths[s] for s in slots]
        rows, width = len(counts), max(counts)
        chain = batch.tree_mask is None
        wide = chain and width > WIDE_TOKENS and self.device.type == "cpu"
        if rows == 1 and chain and not wide and not self.use_cuda_graphs:
            return self._single_row_grid(batch, starts[0], cache)
        if wide:  # padded to one of a few widths (padding cells write to the scratch column)
            width = wide_bucket(width)
        cells = [b * width + t for b, c in enumerate(counts) for t in range(c)]
        write_slot = [s for s in slots for _ in range(width)]
        write_index = [start + t if t < c else cache.capacity
                       for start, c in zip(starts, counts) for t in range(width)]
        host = to_device(write_slot + write_index + cells + starts + list(slots), device)  # one copy
        n, cells_at = len(cells), 2 * rows * width
        cell_index = host[cells_at : cells_at + n]
        starts_t, slots_t = host[cells_at + n : cells_at + n + rows], host[cells_at + n + rows :]
        dense = n == rows * width
        ids, positions = batch.input_ids, batch.positions
        if not dense:
            ids = ids.new_zeros(rows * width).index_copy_(0, cell_index, ids)
            positions = positions.new_zeros(rows * width).index_copy_(0, cell_index, positions)
        needed = max(s + c for s, c in zip(starts, counts))
        single = rows == 1 and width == 1 and batch.tree_mask is None
        key_len = self.key_bucket(needed, cache.capacity, wide)
        first = slots[0]
        g = Grid(rows, width, key_len, ids, positions.view(rows, width), host[: rows * width],
                 host[rows * width : cells_at], starts_t, slots_t,
                 first if list(slots) == list(range(first, first + rows)) else None,
                 needs_mask=not (single and key_len == needed),
                 write_range=None)
        if batch.tree_mask is not None:
            g.mask = self._tree_mask(batch.tree_mask, cell_index, g)
        return g, cell_index

    def _single_row_grid(self, batch: ForwardBatch, start: int, cache: StaticKVPool) -> tuple[Grid, None]:
        """The one-row chain case of :meth:`grid` (every batch-1 step) without index tensors: writes
        and reads are slices, and the cells are the flat tokens themselves (``cell_index`` None)."""
        width, slot = batch.num_tokens[0], batch.slots[0]
        needed = start + width
        key_len = self.key_bucket(needed, cache.capacity)
        g = Grid(1, width, key_len, batch.input_ids, batch.positions.view(1, width), None, None, None, None, slot,
                 needs_mask=not (width == 1 and key_len == needed), write_range=(slot, start))
        return g, None

    def _tree_mask(self, tree_mask: torch.Tensor, cell_index: torch.Tensor, g: Grid) -> torch.Tensor:
        """``[R, 1, T, K]``: the committed context, plus the new tokens the tree lets each token see."""
        rows, width = g.rows, g.width
        tree = tree_mask.new_zeros(rows * width, width)
        tree[:, 0] = True  # padding cells see something (their output is never used)
        tree[cell_index] = tree_mask[:, :width]  # real cells see exactly their tree (new token 0 too)
        rel = torch.arange(g.key_len, device=self.device)[None, None, :] - g.starts[:, None, None]
        inside = (rel >= 0) & (rel < width)
        bits = tree.view(rows, width, width).gather(2, rel.clamp(0, width - 1).expand(rows, width, -1))
        return ((rel < 0) | (inside & bits))[:, None]

    def _chain_mask(self, g: Grid) -> torch.Tensor:
        key = torch.arange(g.key_len, device=self.device)[None, None, :]
        query = torch.arange(g.width, device=self.device)[None, :, None]
        starts = g.write_range[1] if g.starts is None else g.starts[:, None, None]
        return (key <= starts + query)[:, None]

    @staticmethod
    def _cache_access(g: Grid, cache: StaticKVPool) -> tuple[Callable, Callable]:
        """``write(pool, new)`` of new keys or values ``[R, kv_heads, T, head_dim]`` into their cells,
        and ``read(pool, which)``: the attended cache of the grid's rows, ``[R, kv_heads, K, head_dim]``
        (``which``: 0 for keys, 1 for values, whose gathered copies must not share a buffer).
        Chosen once per forward: slices where the layout allows (cheapest on a CPU), else indices
        (on a CPU into :meth:`StaticKVPool.gather_buffers`)."""
        rows, width, key_len = g.rows, g.width, g.key_len
        if g.write_range is not None:
            slot, start = g.write_range

            def write(pool: torch.Tensor, new: torch.Tensor) -> None:
                pool[slot : slot + 1, :, start : start + width] = new
        else:

            def write(pool: torch.Tensor, new: torch.Tensor) -> None:
                pool[g.write_slot, :, g.write_index] = new.transpose(1, 2).reshape(rows * width, *new.shape[1::2])

        if g.first_slot is not None:
            first = g.first_slot

            def read(pool: torch.Tensor, which: int) -> torch.Tensor:
                return pool[first : first + rows, :, :key_len]
        elif cache.keys[0].device.type == "cpu":
            buffers = cache.gather_buffers(rows, key_len)

            def read(pool: torch.Tensor, which: int) -> torch.Tensor:  # only the attended columns are copied
                return torch.index_select(pool[:, :, :key_len], 0, g.slots, out=buffers[which])
        else:  # CUDA's caching allocator reuses the copies' memory (and graphs capture it)

            def read(pool: torch.Tensor, which: int) -> torch.Tensor:
                return pool[:, :, :key_len].index_select(0, g.slots)

        return write, read

    def compute(self, g: Grid, cache: StaticKVPool, hidden_wanted: frozenset[int] = frozenset(),
                layers: tuple[int, ...] | None = None, x: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The layers over a grid: writes keys and values, returns the last layer's output
        ``[R*T, H]`` (before the final norm) and the hidden states of ``hidden_wanted`` layers.
        ``layers``: the layers run (None: all); ``x`` ``[R, T, H]``: their input (None: the embeddings).
        Pure device work with static shapes for a given (R, T, K): capturable as a CUDA graph."""
        rows, width = g.rows, g.width
        nh, nkv = self.num_heads, self.num_kv_heads
        if g.write_range is not None and g.mask is None:  # one chain row: positions are start, start+1, ...
            start = g.write_range[1]
            cos, sin = self.cos[start : start + width], self.sin_signed[start : start + width]
        else:
            cos, sin = self.cos[g.positions][:, None], self.sin_signed[g.positions][:, None]
        mask = g.mask if g.mask is not None or not g.needs_mask else self._chain_mask(g)
        if x is None:
            x = F.embedding(g.ids, self.embed).view(rows, width, -1)
        hidden = {0: x} if 0 in hidden_wanted else {}
        write, read = self._cache_access(g, cache)
        gqa = nkv != nh
        eps = self.eps
        pair = width == 1 and self.pair_single_queries
        for i in range(len(self._layer_args)) if layers is None else layers:
            attention_args, mlp_args = self._layer_args[i]
            q, k, v = self._attention_inputs(x, *attention_args, cos, sin, eps, nh, nkv)
            keys, values = cache.keys[i], cache.values[i]
            write(keys, k)
            write(values, v)
            attn = attend(q, read(keys, 0), read(values, 1), mask, self.scale, gqa, pair)
            x = self._attention_output_and_mlp(x, attn, *mlp_args, eps)
            if i + 1 in hidden_wanted:
                hidden[i + 1] = x
        return x.view(rows * width, -1), hidden

    def head(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm and output head: ``[M, H]`` -> logits ``[M, V]`` (``[M, V']`` scored with ``rows``
        ``[V', H]`` of the head instead of all of it)."""
        return F.linear(rms_norm(x, self.final_norm, self.eps), self.lm_head if rows is None else rows)

    @torch.inference_mode()
    def greedy_chain(self, tokens: torch.Tensor, slots: list[int], cache: StaticKVPool, steps: int,
                     output_head: torch.Tensor | None = None, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        fits = all(cache.lengths[s] + steps <= cache.capacity for s in slots)
        if self.device.type == "cpu" and fits and len(slots) == 1:
            return self._one_row_chain(tokens, slots[0], cache, steps, output_head, token_ids)
        if not (self.use_cuda_graphs and fits) or output_head is not None:
            return super().greedy_chain(tokens, slots, cache, steps, output_head, token_ids)
        if cache.graphs is None:
            cache.graphs = GraphSet.allocate(cache.num_slots, self.device)
        return replay_greedy_chain(self, tokens, slots, cache, steps)

    def _one_row_chain(self, token: torch.Tensor, slot: int, cache: StaticKVPool, steps: int,
                       output_head: torch.Tensor | None, token_ids: torch.Tensor | None) -> torch.Tensor:
        """:meth:`greedy_chain` for one row without graphs (a batch-1 draft on a CPU): each step is
        the grid of :meth:`_single_row_grid` built in place, with no batch, positions tensor or
        output object, since per-call Python is most of a small draft's step there. ``[1, steps]``."""
        start = cache.lengths[slot]
        out = []
        for i in range(steps):
            g = Grid(1, 1, start + i + 1, token, None, None, None, None, None, slot, needs_mask=False,
                     write_range=(slot, start + i))
            token = argmax(self.head(self.compute(g, cache)[0], output_head))
            if token_ids is not None:
                token = token_ids[token]
            out.append(token)
        cache.lengths[slot] += steps
        return torch.stack(out, dim=1)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: StaticKVPool) -> ForwardOutput:
        self.check_fits(batch, cache)
        subset = batch.layers is not None or batch.input_hidden is not None or batch.exit_adapter is not None or \
            batch.output_head is not None
        shape = graph_shape(self, batch, cache) if self.use_cuda_graphs and not subset else None
        if shape is not None:
            if cache.graphs is None:
                cache.graphs = GraphSet.allocate(cache.num_slots, self.device)
            logits, cell_index = replay(self, batch, cache, shape)
            for slot, count in zip(batch.slots, batch.num_tokens):
                cache.lengths[slot] += count
            wanted = cell_index if batch.logits_rows is None else cell_index[batch.logits_rows]
            return ForwardOutput(logits[wanted])
        g, cell_index = self.grid(batch, cache)
        final = len(self.layers)
        wanted_layers = [i if i >= 0 else final + 1 + i for i in batch.hidden_layers]
        x = batch.input_hidden
        if x is not None:  # the flat tokens' input laid out on the grid
            if cell_index is not None:
                x = x.new_zeros(g.rows * g.width, x.shape[-1]).index_copy_(0, cell_index, x)
            x = x.view(g.rows, g.width, -1)
        x, hidden = self.compute(g, cache, frozenset(i for i in wanted_layers if i < final), batch.layers, x)
        for slot, count in zip(batch.slots, batch.num_tokens):
            cache.lengths[slot] += count
        # Grid cells of the wanted flat rows (a single row's cells are its flat tokens).
        if cell_index is None:
            wanted = slice(None) if batch.logits_rows is None else batch.logits_rows
        else:
            wanted = cell_index if batch.logits_rows is None else cell_index[batch.logits_rows]
        last = x[wanted]
        if last.shape[0] == 0:
            return ForwardOutput(x.new_empty(0, self.vocab_size))
        out_hidden = None
        if wanted_layers:
            normed = rms_norm(last, self.final_norm, self.eps)
            out_hidden = torch.stack(
                [normed if i == final else hidden[i].reshape(g.rows * g.width, -1)[wanted] for i in wanted_layers],
                dim=1,
            )
        if batch.exit_adapter is not None:
            last = batch.exit_adapter(last)
        return ForwardOutput(self.head(last, batch.output_head), out_hidden)
