"""The padded grid one fast forward computes, and the attention masks over it.

A ragged :class:`~specdec.models.base.ForwardBatch` is laid out as ``[R, T]`` cells (``T`` the
longest row) for the matrix work; padding cells are computed but write only to a scratch row of
the cache and are never returned. Attention reads ``K`` cache entries of each row's slot; the mask of
a layer says which of them each cell sees: the causal chain or the row's tree, intersected with the
layer's sliding window (keys at positions ``p - window + 1 .. p`` for a query at position ``p``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

WIDE_TOKENS = 16
"""On a CPU, a chain forward whose longest row feeds more than this many tokens (a prefill) is
padded to :func:`wide_bucket` tokens per row, and attends to a bucketed cache length: oneDNN's
half-precision matrix and attention kernels keep state for every shape they see (about 0.5 MB
each), so exact prompt lengths would grow resident memory with every new length."""


def wide_bucket(n: int) -> int:
    """The smallest of 16, 24, 32, 48, 64, 96, ... (two per octave) that is >= ``n``."""
    if n <= WIDE_TOKENS:
        return WIDE_TOKENS
    power = 1 << (n - 1).bit_length()
    return power * 3 // 4 if power * 3 // 4 >= n else power


def padded_width(n: int) -> int:
    """The tokens per row a CPU chain grid computes for a longest row of ``n`` tokens: ``n`` up to
    :data:`WIDE_TOKENS`, else :func:`wide_bucket`."""
    return n if n <= WIDE_TOKENS else wide_bucket(n)


def on_cells(flat: torch.Tensor | None, cell_index: torch.Tensor | None, cells: int) -> torch.Tensor | None:
    """Per-token inputs ``[N, H]`` laid out on a layout's ``cells`` grid cells, ``[cells, H]`` (padding cells zero),
    ``cell_index`` ``[N]`` each token's cell; ``flat`` itself where the cells are the tokens (``cell_index``
    None), None for None."""
    if flat is None or cell_index is None:
        return flat
    return flat.new_zeros(cells, flat.shape[-1]).index_copy_(0, cell_index, flat)


@dataclass
class Grid:
    """The padded ``[R, T]`` grid one forward computes, as device tensors, over a
    :class:`~.kv_pool.PagedKVPool`.

    ``ids`` ``[R*T]`` (padding cells hold token 0), ``positions`` ``[R, T]``, ``write_index``
    ``[R*T]``: the cache index (within its row's slot) each cell writes, -1 for padding cells (they
    write to the pool's scratch row, never attended); ``starts`` ``[R]``: the cached length of each
    row before the forward (None with ``write_range``, which holds it); ``table`` ``[R, ceil(K / B)]``:
    the rows' block tables, through which writes and reads are addressed (None with ``write_range``).
    ``key_len`` ``K``: cache entries attended to; ``mask`` ``[R, 1, T, K]`` or None (then the causal
    chain mask is derived from ``starts``; with ``R = T = 1`` and ``K`` exact no mask is needed:
    ``needs_mask`` False). ``key_positions`` ``[R, K]``: with a tree ``mask``, the position of every
    attended entry (windows compare positions). ``write_range``: ``(row, start)`` when one row's
    attended entries are the consecutive storage rows from ``row`` on (its blocks are consecutive):
    cells write to ``row + start ..`` and reads are slices, cheaper on a CPU than indexing; else None.
    """

    rows: int
    width: int
    key_len: int
    ids: torch.Tensor
    positions: torch.Tensor | None
    write_index: torch.Tensor | None
    starts: torch.Tensor | None
    table: torch.Tensor | None
    mask: torch.Tensor | None = None
    needs_mask: bool = True
    write_range: tuple[int, int] | None = None
    key_positions: torch.Tensor | None = field(default=None)


def storage_rows(g: Grid, block_size: int, scratch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool storage rows a gridded forward writes, ``[R*T]`` (padding cells: ``scratch``), and reads,
    ``[R*K]`` (row-major), from the grid's block ``table`` (device work only: capturable in a CUDA graph)."""
    rows, width = g.rows, g.width
    index = g.write_index.view(rows, width)
    block = g.table.gather(1, index.clamp(min=0) // block_size)
    write = torch.where(index >= 0, block * block_size + index % block_size, scratch).view(-1)
    offsets = torch.arange(block_size, device=g.table.device)
    read = (g.table[:, :, None] * block_size + offsets).view(rows, -1)[:, : g.key_len].reshape(-1)
    return write, read


def write_rows(pool: torch.Tensor, rows: torch.Tensor, new: torch.Tensor) -> None:
    """Write new keys or values ``new`` ``[R, kv_heads, T, head_dim]`` into ``pool`` ``[S, kv_heads, head_dim]``
    at storage rows ``rows`` ``[R*T]`` (row-major cells, as :func:`storage_rows` gives them)."""
    pool.index_put_((rows,), new.transpose(1, 2).reshape(rows.shape[0], *new.shape[1::2]))


def read_rows(pool: torch.Tensor, rows: torch.Tensor, num_rows: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The attended entries of ``num_rows`` grid rows, ``[R, kv_heads, K, head_dim]``, gathered from ``pool`` at
    storage rows ``rows`` ``[R*K]`` (row-major, as :func:`storage_rows` gives them); into ``out`` if given."""
    gathered = torch.index_select(pool, 0, rows) if out is None else torch.index_select(pool, 0, rows, out=out)
    return gathered.view(num_rows, -1, *pool.shape[1:]).transpose(1, 2)


def tree_bits(tree: torch.Tensor, cell_index: torch.Tensor, rows: int, width: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """The new tokens each cell of an ``[R, T]`` grid sees, ``[R*T, T]`` bool (into ``out`` if given): a real
    cell its row of ``tree`` ``[N, T_max]`` (``T_max <= T``; new token 0 too), a padding cell only token 0
    (its output is never used, but a cell that sees nothing would give NaN)."""
    bits = tree.new_zeros(rows * width, width) if out is None else out.zero_()
    bits[:, 0] = True
    bits[cell_index, : tree.shape[1]] = tree[:, :width]
    return bits


def tree_mask(bits: torch.Tensor, g: Grid) -> tuple[torch.Tensor, torch.Tensor]:
    """A tree forward's mask ``[R, 1, T, K]`` from its cells' :func:`tree_bits` ``[R*T, T]``: the committed
    context, plus the new tokens each cell sees; and the position of every attended entry ``[R, K]`` (a
    committed entry's index, a new token's tree position). Device work only (capturable in a CUDA graph)."""
    rows, width = g.rows, g.width
    key = torch.arange(g.key_len, device=bits.device)
    rel = key[None, :] - g.starts[:, None]  # [R, K]
    inside = (rel >= 0) & (rel < width)
    column = rel.clamp(0, width - 1)
    seen = bits.view(rows, width, width).gather(2, column[:, None, :].expand(rows, width, -1))
    key_positions = torch.where(inside, g.positions.gather(1, column), key[None, :])
    return ((rel < 0)[:, None, :] | (inside[:, None, :] & seen))[:, None], key_positions


def chain_mask(g: Grid, window: int | None) -> torch.Tensor:
    """``[R, 1, T, K]``: cell ``t`` of a chain row starting at ``s`` sees entries ``<= s + t``, and with a
    ``window`` only those ``> s + t - window``. (A padding cell's window is clamped so that it sees the
    last attended entry: a cell that sees nothing would give NaN.)"""
    device = g.ids.device
    key = torch.arange(g.key_len, device=device)[None, None, :]
    query = torch.arange(g.width, device=device)[None, :, None]
    starts = g.write_range[1] if g.starts is None else g.starts[:, None, None]
    mask = key <= starts + query
    if window is not None:
        mask = mask & (key > (starts + query - window).clamp(max=g.key_len - 2))
    return mask[:, None]


def attention_view(g: Grid, window: int | None) -> tuple[torch.Tensor | None, int]:
    """What a layer with ``window`` (None: global) attends over the grid: ``(mask, first)``, the mask
    ``[R, 1, T, K - first]`` or None, over the attended entries from index ``first`` on. A single query
    with an exact key length needs no mask: with a window, it reads only the window's entries."""
    if g.mask is not None:
        if window is None:
            return g.mask, 0
        inside = g.key_positions[:, None, None, :] > g.positions[:, None, :, None] - window
        return g.mask & inside, 0
    if not g.needs_mask:
        return None, max(0, g.key_len - window) if window is not None else 0
    return chain_mask(g, window), 0
