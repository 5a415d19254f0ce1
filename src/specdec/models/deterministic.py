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
  blocks combined in ascending order: every product reduces over ``head_dim`` or one block, with the queries as
  its columns in a multiple of :data:`QUERY_TILE`. Which operand is the product's rows matters: on the AMX Xeon
  (MKL), a float32 product of the queries (as rows) with the keys transposed gives a query other bits at 8 rows than
  at 4 for a head size of 128; with the keys as the rows and the queries as the columns, a query's column has the
  same bits for any number of columns and keys (``docs/lab-notes/2026-11-30-amx-host.md``). On the AVX2 EPYC a
  column's bits are the same for 4 or 8 columns and for any multiple of 16, but not across the two: a verification
  (5 tokens: 10-40 query columns) gave the decode's query other float32 bits until the columns were padded to 16
  (``docs/lab-notes/2026-12-03-float32-determinism.md``; bfloat16 outputs had rounded the difference away).
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

QUERY_TILE = 16
""":func:`attend`'s queries are its products' columns, padded to a multiple of this many: a column's bits are then
the same for any number of columns (on the AVX2 EPYC in float32, 4 or 8 columns take another kernel than 12 or
more; 16, 32, ... 1024 agree, and with any number of key rows)."""

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
    fixed per query. The queries (``heads // kv_heads * T`` per KV head) are the columns of both products, padded to
    a multiple of :data:`QUERY_TILE` (zeros); the keys are the rows of the first. Scores in float32 (products over
    ``head_dim``), masked, the query's maximum subtracted (a maximum is exact in any order), then per block of
    :data:`KEY_BLOCK` keys at offsets ``0, 64, ...`` the products of the values (as rows: the stored values
    transposed, a view) and of a row of ones (the exponentials' sum) with the exponentials, and the blocks summed in
    ascending order (a masked key adds an exact zero, so keys past the query's last visible one change nothing).
    ``K`` not a multiple of the block is padded (masked zeros). ``softcap``: scores become ``c * tanh(s / c)``
    before the mask. Returns ``[R, heads, T, head_dim]`` in ``q``'s dtype."""
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
    columns = -(-queries // QUERY_TILE) * QUERY_TILE
    more = columns - queries
    q_columns = F.pad(q.reshape(rows, kv_heads, queries, head_dim).float().transpose(2, 3), (0, more)).contiguous()
    rows_of_keys = keys.to(torch.float32, memory_format=torch.contiguous_format)
    scores = torch.matmul(rows_of_keys, q_columns) * scale  # [R, kvh, K, C]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    visible = mask[:, :, None].expand(rows, 1, group, width, padded).reshape(rows, 1, queries, padded)
    visible = F.pad(visible.transpose(2, 3), (0, more), value=True)  # [R, 1, K, C]; padded queries see every key
    scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.exp(scores - scores.amax(dim=2, keepdim=True))
    blocks = padded // KEY_BLOCK
    weights = weights.view(rows, kv_heads, blocks, KEY_BLOCK, columns)
    rows_of_values = values.float().view(rows, kv_heads, blocks, KEY_BLOCK, head_dim).transpose(3, 4)  # a view
    per_block = torch.matmul(rows_of_values, weights)  # [R, kvh, blocks, D, C]
    ones = torch.ones(1, KEY_BLOCK, dtype=torch.float32, device=q.device)
    sums = torch.matmul(ones, weights)  # [R, kvh, blocks, 1, C]: a product too (a sum over the keys is not invariant)
    out = per_block.cumsum(dim=2)[:, :, -1] / sums.cumsum(dim=2)[:, :, -1]  # blocks in order: [R, kvh, D, C]
    out = out[..., :queries]  # [R, kvh, D, G*T]
    return out.transpose(2, 3).reshape(rows, heads, width, head_dim).to(q.dtype)
