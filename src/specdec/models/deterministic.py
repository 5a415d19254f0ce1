"""The fast backend's batch-invariant arithmetic: each row's result does not depend on how many rows,
tokens or keys a forward has, nor on the row's place in it (``LLM(..., deterministic=True)``).

What is not batch-invariant by default, measured on the 2-core AMD EPYC (Zen 4, avx512_bf16,
torch 2.13, 2 threads; ``docs/lab-notes/2026-11-24-determinism.md``), row ``i`` of a forward over
``M`` rows compared bit for bit with the same row computed alone:

- **matrix products**: in bfloat16 (oneDNN-prepacked and plain ``F.linear``) one row (``M = 1``)
  takes a different reduction than two or more rows once the reduced width exceeds 1024 (every
  1b-shape matrix, the output head included: 1 to 4 of 4 probe rows differ by an ulp); every ``M``
  from 2 to 3072 gives the same bits for a row, at any place in the batch. In float32 and float64
  (MKL) ``M`` of 1 to 3 each differ from ``M >= 4``, and the last ``M mod 4`` rows of a larger ``M``
  take another kernel too; over any multiple of 4 rows every row has the same bits (both with 1 and
  2 threads). Fix: :func:`rows_linear` gives every product a multiple of :data:`ROW_TILE` rows
  (memory-bound small products cost about the same for 1 and 4 rows: the weights are read once),
  except a packed bfloat16 one, which :func:`~.cpu_linear.linear` already computes over 4 rows where it
  has fewer (in both modes: oneDNN's one-row kernel was the slower one too), so a verification's 5 rows
  are not padded to 8.
- **matrix products where oneDNN runs AMX** (a 2-core Intel Xeon with ``amx_bf16``, torch 2.13, 2 threads;
  ``docs/lab-notes/2026-11-30-amx-host.md``): a bfloat16 row has the same bits for every row count from 1 to 32
  and others past 32 (2-28 of 33-40 rows differ for 1,024-8,192 outputs), and a plain float32 row the same from 4
  to 12 and others from 13 (every row). Fix: :func:`rows_linear` computes a product a block of at most
  :data:`ROW_BLOCK` rows at a time (32 for bfloat16, 8 for the others).
- **attention** (torch's CPU flash SDPA): a query's output changes with the number of queries
  (4 or more against the decode's pair), with the attended key length (a longer row in the batch,
  or a verification's extra keys) and with the split of the keys into blocks. Fix: :func:`attend`,
  explicit attention over fixed blocks of :data:`KEY_BLOCK` keys at fixed offsets, in float32, the
  blocks combined in ascending order: every product reduces over ``head_dim`` or one block. On the AMX Xeon
  (MKL), a float32 product of the queries (as rows) with the keys transposed gives a query other bits at 8 rows than
  at 4 for a head size of 128; with the keys as the rows and the queries as the columns, a query's column has the
  same bits for any number of columns and keys (``docs/lab-notes/2026-11-30-amx-host.md``).
- **RMSNorm, rotary, activations, residuals, the argmax**: per row already (no difference measured).

The logits stay in the model's dtype (an argmax over identical logits is identical, ties included);
sampling reads each row's logits with its own generator, so it needs nothing more.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.models.cpu_linear import over_rows, pads_few_rows, row_invariant

KEY_BLOCK = 64
"""Keys per block of :func:`attend`; the attended key length is padded to a multiple of it."""

ROW_TILE = 4
"""Every matrix product is given a multiple of this many rows (the missing ones are copies of the first)."""

ROW_BLOCK = {torch.bfloat16: 32}
"""The most rows one product computes, by weight dtype (:data:`OTHER_ROW_BLOCK` for the others): a product over
more is computed a block at a time. Where oneDNN runs AMX, a bfloat16 row's bits are the same for every row count
from 1 to 32 and change past it, and a plain float32 row's (MKL) from 4 to 12 and past it."""

OTHER_ROW_BLOCK = 8
"""The most rows one product computes with a weight whose dtype :data:`ROW_BLOCK` does not name."""


def rows_linear(fn, x: torch.Tensor, *args) -> torch.Tensor:
    """``fn(x, *args)`` (a linear over the last dim of ``x`` ``[..., in]``, ``args[0]`` its weight) computed a
    block of at most :data:`ROW_BLOCK` rows at a time, each over a multiple of :data:`ROW_TILE` rows: the rows are
    padded with copies of the first and only theirs kept. A oneDNN-packed bfloat16 weight needs no padding: every
    row count from 2 to the block takes the same kernel, and :func:`~.cpu_linear.linear` computes fewer rows than 4
    as 4 where one row would take another; a bfloat16-stored weight (:mod:`.bf16_product`) gives a row the same
    bits at every row count, so its product is computed as it is. Returns ``[..., out]``."""
    if row_invariant(args[0]):
        return fn(x, *args)
    width = x.shape[-1]
    count = x.numel() // width
    block = ROW_BLOCK.get(args[0].dtype, OTHER_ROW_BLOCK)
    if count > block:
        flat = x.reshape(count, width)
        out = torch.cat([rows_linear(fn, flat[i : i + block], *args) for i in range(0, count, block)])
        return out.reshape(*x.shape[:-1], out.shape[-1])
    if count % ROW_TILE == 0 or pads_few_rows(args[0]):
        return fn(x, *args)
    return over_rows(fn, x, count + ROW_TILE - count % ROW_TILE, *args)


def pad_keys(key_len: int) -> int:
    """The attended key length :func:`attend` computes over for ``key_len`` keys."""
    return -(-key_len // KEY_BLOCK) * KEY_BLOCK


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float | None = None) -> torch.Tensor:
    """Scaled dot-product attention of ``q`` ``[R, heads, T, head_dim]`` over ``keys`` and ``values``
    ``[R, kv_heads, K, head_dim]`` (``mask`` ``[R, 1, T, K]`` bool or None: all visible), with a reduction order
    fixed per query: scores in float32 (products over ``head_dim``, a query's scores one column of a product whose
    rows are the keys), masked, the query's maximum subtracted (a maximum is exact in any order), then per block of
    :data:`KEY_BLOCK` keys at offsets ``0, 64, ...`` the exponentials' sum and their product with the values, and
    the blocks summed in ascending order (a masked key adds an exact zero, so keys past the query's last visible one
    change nothing). ``K`` not a multiple of the block is padded (masked zeros). The queries
    (``heads // kv_heads * T`` per KV head) are padded to a multiple of :data:`ROW_TILE`. ``softcap``: scores become
    ``c * tanh(s / c)`` before the mask. Returns ``[R, heads, T, head_dim]`` in ``q``'s dtype."""
    rows, heads, width, head_dim = q.shape
    kv_heads, key_len = keys.shape[1], keys.shape[2]
    padded = pad_keys(key_len)
    if mask is None:
        mask = torch.ones(rows, 1, width, key_len, dtype=torch.bool, device=q.device)
    if padded != key_len:
        extra = padded - key_len
        keys, values = F.pad(keys, (0, 0, 0, extra)), F.pad(values, (0, 0, 0, extra))
        mask = F.pad(mask, (0, extra), value=False)
    group = heads // kv_heads  # query head h reads kv head h // group
    queries = group * width
    if queries % ROW_TILE:  # a partial row tile takes other kernels: pad with copies of the first query
        more = next(t for t in range(width + 1, width + ROW_TILE + 1) if group * t % ROW_TILE == 0) - width
        q = torch.cat([q, q[:, :, :1].expand(-1, -1, more, -1)], dim=2)
        mask = torch.cat([mask, mask[:, :, :1].expand(-1, -1, more, -1)], dim=2)
        return attend(q, keys, values, mask, scale, softcap)[:, :, :width]
    # The keys are the score product's rows and the queries its columns: a column's bits do not depend on how many
    # columns there are, where a row's of a product with a transposed right operand (queries as rows against the
    # keys transposed) change with the row count on the AMX Xeon for a head size of 128.
    columns = q.reshape(rows, kv_heads, queries, head_dim).transpose(2, 3).float().contiguous()  # [R, kvh, D, G*T]
    rows_of_keys = keys.to(torch.float32, memory_format=torch.contiguous_format)  # both operands contiguous
    scores = torch.matmul(rows_of_keys, columns) * scale  # [R, kvh, K, G*T]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    visible = mask[:, :, None].expand(rows, 1, group, width, padded).reshape(rows, 1, queries, padded)
    scores = scores.masked_fill(~visible.transpose(2, 3), float("-inf"))
    weights = torch.exp(scores - scores.amax(dim=2, keepdim=True))
    blocks = padded // KEY_BLOCK
    weights = weights.view(rows, kv_heads, blocks, KEY_BLOCK, queries)
    # Back to a query per row before the sums over the keys: a sum over a dim that is not the innermost one changes
    # its order with the number of queries.
    weights = weights.transpose(3, 4).contiguous()  # [R, kvh, blocks, G*T, B]
    total = weights.sum(dim=-1).cumsum(dim=2)[:, :, -1, :, None]  # [R, kvh, G*T, 1], blocks in order
    per_block = torch.matmul(weights, values.float().view(rows, kv_heads, blocks, KEY_BLOCK, head_dim))
    out = per_block.cumsum(dim=2)[:, :, -1] / total  # [R, kvh, G*T, D]
    return out.view(rows, heads, width, head_dim).to(q.dtype)
