"""The fast backend's matrix products on a CPU: oneDNN-prepacked float32 and bfloat16 weights, and float32
weights of bfloat16 values stored in bfloat16 where oneDNN has no bfloat16 kernel (:mod:`.bf16_product`).

``F.linear`` over a plain ``[out, in]`` bfloat16 weight reorders the weight's blocks on every call;
a weight packed once into oneDNN's own blocked layout (an opaque ``torch._mkldnn`` tensor) is read
as it lies. On the 2-core AMD EPYC (Zen 4, avx512_bf16, torch 2.13), one row through the 1b shape's
matrices ran at 16-20 GB/s with ``F.linear`` and 26-33 GB/s packed, 2-5 rows (verification) at
17-21 against 25-43 GB/s, and 64 rows (compute bound) 1.15-1.2x faster. In float32, ``F.linear`` (MKL's
sgemm) on a 2-core AMD EPYC with AVX2 only read one row at 10-12 GB/s and took 2.0-4.3 times as long for
2-5 rows as for one, where the packed product took 1.0-1.4 times as long: verification cost what k + 1 plain
steps cost, and auto k turned speculation off. See ``docs/cpu-performance.md``. The packed product gives
the same values as ``F.linear`` within the dtype's rounding of the output.

:func:`pack` replaces a weight by its packed copy where that pays (:func:`packs`: a CPU, float32, or
bfloat16 where oneDNN supports it); :func:`linear` runs whichever it is given. Float64 weights (the exactness
tests) and every CUDA weight stay plain (float16 packing needs avx512_fp16 or avx_ne_convert, which these
CPUs lack). A packed weight has no strides or storage that other code could read: only the fast backend's
own decoder-layer weights are packed, never a tensor it shares (the embeddings and the output head, which
head drafters, draft vocabularies and ``output_head`` row subsets read); the output head's own product
reads a second, packed copy where it is small enough (:func:`packed_copy`), and so does a draft
vocabulary's product (:class:`~specdec.drafters.draft_vocab.DraftVocab`). A drafter's own small modules (an
EAGLE layer's ``fc``, Medusa's blocks, MTP's depths, an early exit's adapter) run their products packed
after :func:`pack_linears`, and so do a published EAGLE or Medusa head's matrices. At 4 rows on the AVX2
EPYC, drafting with the embedded EAGLE layer, its ``fc`` ``[512, 1024]`` took 0.62 ms through ``F.linear`` and
0.24 ms packed, its draft vocabulary's 1,024 head rows 0.73 and 0.23 ms
(``docs/lab-notes/2026-11-29-packed-drafters.md``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models import bf16_product

PACKED_DTYPES = (torch.bfloat16, torch.float32)
"""Model dtypes whose CPU decoder-layer weights are packed (bfloat16 where oneDNN supports it)."""

FEW_ROWS = 4
"""A packed bfloat16 product over fewer rows than this, reducing over more than :data:`ONE_ROW_WIDTH`, is computed over
this many (the extra rows copies of the first). oneDNN takes a one-row kernel for one row there, which read
the ``1b`` shape's weights slower than its kernel for four rows: plain decoding at ``1b`` ran 11.8 -> 14.2
tok/s with the rows padded to 4 (10.6 padded to 2; ``docs/lab-notes/2026-11-25.md``). From 2 rows on, every
row count takes the same kernel (:mod:`.deterministic`), so a padded row has the bits of a verified one."""

ONE_ROW_WIDTH = 1024
"""The reduced width above which oneDNN's bfloat16 product takes its one-row kernel for one row (its float32
product read one row as fast as two on the AVX2 EPYC, and gave a row the same bits at any row count)."""

COPY_BYTES = 256 * 1024 * 1024
"""The largest shared weight :func:`packed_copy` keeps a second, packed copy of (the output head of a model
of up to about 1B parameters in float32; a larger one stays plain rather than take that much memory again)."""


def packs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :func:`pack` packs weights of ``dtype`` on ``device``."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack(weight: torch.Tensor, bfloat16_storage: bool = True) -> torch.Tensor:
    """``weight`` ``[out, in]`` in the form :func:`linear` reads fastest: stored in bfloat16 where it is a float32
    weight of bfloat16 values (:mod:`.bf16_product`, unless ``bfloat16_storage`` is false: for comparisons), else
    in oneDNN's packed layout (a ``torch._mkldnn`` tensor of the same shape and dtype) where :func:`packs` says
    so, else ``weight`` itself. The caller drops its plain copy."""
    stored = bf16_product.blocked(weight) if bfloat16_storage else None
    if stored is not None:
        return stored
    if not packs(weight.device, weight.dtype):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """A packed copy of a shared ``weight`` ``[out, in]`` (the output head, which drafters and draft
    vocabularies read as a plain tensor) where :func:`pack` would pack it (:func:`packs`, or a bfloat16-stored
    copy) and ``weight`` takes at most :data:`COPY_BYTES`, else None."""
    if weight.numel() * weight.element_size() > COPY_BYTES:
        return None
    copy = pack(weight)
    return None if copy is weight else copy


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``: ``x`` ``[..., in]``, ``weight`` ``[out, in]`` plain or packed, ``bias``
    ``[out]`` or None; returns ``[..., out]`` in ``x``'s dtype. A packed bfloat16 product over fewer than
    :data:`FEW_ROWS` rows of more than :data:`ONE_ROW_WIDTH` is computed over :data:`FEW_ROWS`."""
    if bf16_product.is_blocked(weight):
        return bf16_product.linear(x, weight, bias)
    if not weight.is_mkldnn:
        return F.linear(x, weight, bias)
    if not pads_few_rows(weight) or x.numel() // x.shape[-1] >= FEW_ROWS or x.shape[-1] <= ONE_ROW_WIDTH:
        return _packed(x, weight, bias)
    return over_rows(_packed, x, FEW_ROWS, weight, bias)


def pads_few_rows(weight: torch.Tensor) -> bool:
    """Whether :func:`linear` computes a product with ``weight`` over fewer than :data:`FEW_ROWS` rows (reducing
    over more than :data:`ONE_ROW_WIDTH`) as :data:`FEW_ROWS`: a packed bfloat16 weight, whose products then
    give a row the same bits at every row count."""
    return weight.is_mkldnn and weight.dtype == torch.bfloat16


def _packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def over_rows(fn, x: torch.Tensor, rows: int, *args) -> torch.Tensor:
    """``fn(x, *args)`` (a product over the last dim of ``x`` ``[..., in]``) computed over ``rows`` rows, at
    least ``x``'s: the rows are padded with copies of the first and only theirs kept. Returns ``[..., out]``."""
    width = x.shape[-1]
    count = x.numel() // width
    flat = x.reshape(count, width)
    padded = torch.cat([flat, flat[:1].expand(rows - count, -1)])
    return fn(padded, *args)[:count].view(*x.shape[:-1], -1)


def is_packed(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a packed weight of :func:`pack`."""
    return weight.is_mkldnn or bf16_product.is_blocked(weight)


def row_invariant(weight: torch.Tensor) -> bool:
    """Whether :func:`linear` gives a row with ``weight`` the same bits at every row count (a bfloat16-stored
    weight: one chain of multiply-adds per output, :mod:`.bf16_product`)."""
    return bf16_product.is_blocked(weight)


class PackedLinear(nn.Module):
    """An inference-only ``nn.Linear``: ``weight`` ``[out, in]`` packed where :func:`packs` says so (else
    plain), ``bias`` ``[out]`` or None; ``forward`` ``[..., in]`` -> ``[..., out]`` through :func:`linear`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = pack(weight.detach())
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def pack_linears(module: nn.Module, skip: tuple[str, ...] = ()) -> nn.Module:
    """``module`` with every ``nn.Linear`` in it (but under the children named in ``skip``) replaced by a
    :class:`PackedLinear`, in place, for inference: its weights are then read as :func:`linear` reads them,
    and no longer train. Returns ``module``."""
    for name, child in list(module.named_children()):
        if name in skip:
            continue
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias))
        else:
            pack_linears(child)
    return module
