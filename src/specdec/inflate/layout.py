"""Where every coordinate of a small decoder lands in a larger one: the index maps of a
function-preserving inflation (:mod:`specdec.inflate`).

The construction, for a source of hidden width ``d`` and ``n`` layers inflated to width ``D`` and
``N`` layers:

- the hidden width is zero-padded: source coordinate ``c`` is inflated coordinate ``c``, the others
  stay exactly zero in the residual stream because every matrix that writes into it (embedding,
  ``o_proj``, ``down_proj``) has zero rows there;
- attention heads keep their width (``head_dim``); extra query heads, KV heads and MLP units have
  zero weights, so their output projection columns (``o_proj``, ``down_proj``) are zero;
- the grouped-query map is kept: source query head ``i`` of KV group ``j`` lands in a group whose KV
  head is a copy of source KV head ``j`` (:meth:`Layout.q_heads`, :meth:`Layout.kv_heads`);
- source layer ``i`` sits at position ``p(i) = floor((i + 1) N / n) - 1`` (:attr:`Layout.layer_at`):
  the extra, all-zero layers (which add exactly zero to the residual) are spread between them, so
  the last source layer is the last layer, an early exit after a fraction of the layers costs that
  fraction of the inflated model, and a layer skip set sees real layers where it would in a real model;
- RMSNorm weights are multiplied by ``sqrt(d / D)`` and ``rms_norm_eps`` by ``d / D``. For a padded
  vector ``x' = [x, 0]``, ``mean(x'^2) = (d / D) mean(x^2)``, so
  ``x' / sqrt(mean(x'^2) + eps d / D) = sqrt(D / d) x / sqrt(mean(x^2) + eps)`` exactly: the scaled weight
  undoes the factor and the normed vector equals the source's (and is zero in the padding).

Hence every logit equals the source's up to floating-point rounding (sums over longer, zero-padded
rows may round differently; in bfloat16 the scaled norm weights are rounded once, unless
``sqrt(d / D)`` is a power of two, as for 512 -> 2048).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.errors import SpecDecError


@dataclass(frozen=True)
class Dims:
    """A decoder's widths: ``heads * head_dim`` is the query width, ``kv_heads * head_dim`` the KV width."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int


@dataclass(frozen=True)
class AxisMap:
    """Source index ``src[j]`` lands at ``dst[j]`` along an axis of length ``size`` (``[m]`` each)."""

    src: torch.Tensor
    dst: torch.Tensor
    size: int

    @staticmethod
    def prefix(n: int, size: int) -> AxisMap:
        """The first ``n`` of ``size`` coordinates, in place."""
        index = torch.arange(n)
        return AxisMap(index, index, size)

    @staticmethod
    def cat(parts: Sequence[AxisMap], src_sizes: Sequence[int]) -> AxisMap:
        """Concatenated axes (``[a; b]`` inputs of fused layers): part ``i`` of source length
        ``src_sizes[i]`` maps into part ``i`` of the inflated axis."""
        src, dst, s_off, d_off = [], [], 0, 0
        for part, n in zip(parts, src_sizes):
            src.append(part.src + s_off)
            dst.append(part.dst + d_off)
            s_off, d_off = s_off + n, d_off + part.size
        return AxisMap(torch.cat(src), torch.cat(dst), d_off)


def place(tensor: torch.Tensor, axes: Sequence[AxisMap], scale: float = 1.0) -> torch.Tensor:
    """A zero tensor of the inflated shape (``[a.size for a in axes]``, ``tensor``'s dtype) holding
    ``tensor`` ``[n_0, ...]`` at the mapped indices, multiplied by ``scale`` (in float64, rounded once)."""
    if tensor.ndim != len(axes):
        raise SpecDecError(f"cannot inflate a tensor of shape {tuple(tensor.shape)} along {len(axes)} axes")
    out = torch.zeros([a.size for a in axes], dtype=tensor.dtype)
    values = tensor if scale == 1.0 else (tensor.double() * scale).to(tensor.dtype)
    if tensor.ndim == 1:
        out[axes[0].dst] = values[axes[0].src]
    else:
        rows, cols = axes
        out[rows.dst[:, None], cols.dst[None, :]] = values[rows.src[:, None], cols.src[None, :]]
    return out


class Layout:
    """The index maps from ``src`` to ``dst`` dims (checked: nothing of ``dst`` is smaller)."""

    def __init__(self, src: Dims, dst: Dims, what: str = "the shape") -> None:
        smaller = [f"{name} {getattr(dst, name)} < {getattr(src, name)}"
                   for name in ("hidden", "layers", "intermediate") if getattr(dst, name) < getattr(src, name)]
        if dst.head_dim != src.head_dim:
            smaller.append(f"head_dim {dst.head_dim} != {src.head_dim}")
        group, dst_group = src.heads // src.kv_heads, dst.heads // dst.kv_heads
        copies = -(-group // dst_group)
        if src.kv_heads * copies > dst.kv_heads or dst.heads < src.heads:
            smaller.append(f"{dst.heads}/{dst.kv_heads} heads cannot hold {src.heads}/{src.kv_heads} "
                           "with their grouping")
        if smaller:
            raise SpecDecError(f"{what} is smaller than the source: {', '.join(smaller)}")
        self.src, self.dst, self.copies = src, dst, copies
        self.layer_at = tuple((i + 1) * dst.layers // src.layers - 1 for i in range(src.layers))
        """Position of each source layer in the inflated model (increasing; the last is ``N - 1``)."""
        self.norm_scale = math.sqrt(src.hidden / dst.hidden)
        self.eps_scale = src.hidden / dst.hidden

    @property
    def hidden(self) -> AxisMap:
        return AxisMap.prefix(self.src.hidden, self.dst.hidden)

    @property
    def mlp(self) -> AxisMap:
        return AxisMap.prefix(self.src.intermediate, self.dst.intermediate)

    def widen(self, intermediate: int) -> int:
        """A head's MLP width grown by the target's MLP ratio (at least the source width)."""
        return max(intermediate, -(-intermediate * self.dst.intermediate // self.src.intermediate))

    def q_heads(self) -> AxisMap:
        """Source query head ``i = j * g + r`` (KV group ``j``, ``g`` heads a group) lands at
        ``(j * copies + r // G) * G + r % G`` of the ``G``-head groups, whose KV head copies source head ``j``."""
        group, dst_group = self.src.heads // self.src.kv_heads, self.dst.heads // self.dst.kv_heads
        dst = [((i // group) * self.copies + (i % group) // dst_group) * dst_group + (i % group) % dst_group
               for i in range(self.src.heads)]
        return self._rows(list(range(self.src.heads)), dst, self.dst.heads)

    def kv_heads(self) -> AxisMap:
        """Source KV head ``j`` is copied to heads ``j * copies .. j * copies + copies - 1``."""
        src = [j for j in range(self.src.kv_heads) for _ in range(self.copies)]
        dst = [j * self.copies + c for j in range(self.src.kv_heads) for c in range(self.copies)]
        return self._rows(src, dst, self.dst.kv_heads)

    def _rows(self, src_heads: list[int], dst_heads: list[int], num_heads: int) -> AxisMap:
        hd = self.src.head_dim
        offsets = torch.arange(hd)
        src = (torch.tensor(src_heads)[:, None] * hd + offsets).flatten()
        dst = (torch.tensor(dst_heads)[:, None] * hd + offsets).flatten()
        return AxisMap(src, dst, num_heads * hd)

    def hidden_index(self, index: int) -> int:
        """Where transformers' ``hidden_states[index]`` of the source (0 the embeddings, ``i`` layer
        ``i - 1``'s output, ``n`` the final normed state; negative from the end) is in the inflated
        model: the output of the layer that source layer ``index - 1`` became."""
        if index < 0:
            index += self.src.layers + 1
        if not 0 <= index <= self.src.layers:
            raise SpecDecError(f"hidden state {index} out of range for {self.src.layers} layers")
        return 0 if index == 0 else self.layer_at[index - 1] + 1
