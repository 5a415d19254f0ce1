"""The decoder layer's arithmetic as pure tensor functions, the same as transformers' eager forward of
each family (:mod:`.families`): norms, the attention inputs (projection, q/k norms, rotary), the
attention itself (SDPA, or explicit where scores are soft-capped), the dense MLP and routed experts.

They call torch's operators directly, not their Python wrappers where that saves a call: on a CPU
a small model's step is bound by per-call cost. A dense layer's matrix products go through
:func:`~.cpu_linear.linear` (a oneDNN-prepacked weight on a CPU in bfloat16, else ``F.linear``).
Under CUDA graphs :mod:`.fast_llama` compiles :func:`decoder_layer` (a dense layer whole, its cache
write and gather included) or, for routed layers, the pieces around the experts, with torch.compile; every
argument that is not a tensor is a constant there (dims, eps, flags, the activation's name).
``deterministic`` (the backend's batch-invariant mode) selects :mod:`.deterministic`'s matrix products
and attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.models import deterministic as det
from specdec.models import grid
from specdec.models.cpu_linear import linear


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, deterministic: bool) -> torch.Tensor:
    """:func:`~.cpu_linear.linear`, with ``deterministic`` as :func:`~.deterministic.rows_linear` computes it."""
    return det.rows_linear(linear, x, weight, bias) if deterministic else linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """RMSNorm over the last dim of ``x``, statistics in float32. ``offset`` (Gemma): ``weight`` holds
    ``1 + w`` in float32 and the product is cast to ``x``'s dtype; else (Llama) ``weight`` times the
    normalised input cast to ``x``'s dtype. ``weight`` ``[D]`` or broadcastable to ``x`` (per-head norms)."""
    if offset:
        return (torch.rms_norm(x.float(), x.shape[-1:], None, eps) * weight).to(x.dtype)
    if x.dtype == torch.float32 and weight.dim() == 1:
        return torch.rms_norm(x, weight.shape, weight, eps)
    return weight * torch.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype)


def activation(x: torch.Tensor, name: str) -> torch.Tensor:
    """transformers' ``ACT2FN[name]`` for the names of :data:`~.families.ACTIVATIONS`."""
    if name == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu(x)
    return F.silu(x)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of the first ``cos.shape[-1]`` dims of ``x`` (``sin`` signed: ``rotate_half(x) *
    sin == x.roll(half) * [-sin_lo, sin_hi]``, one roll instead of slices and a cat)."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + x.roll(dim // 2, dims=-1) * sin
    rot, rest = x.split_with_sizes((dim, x.shape[-1] - dim), dim=-1)
    return torch.cat([rot * cos + rot.roll(dim // 2, dims=-1) * sin, rest], dim=-1)


def attention_inputs(
    x: torch.Tensor, norm: torch.Tensor, qkv_weight: torch.Tensor, qkv_bias: torch.Tensor | None,
    qk_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float, num_heads: int,
    num_kv_heads: int, offset: bool, deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm, fused q/k/v projection, per-head q/k norms (``qk_norm`` ``[heads + kv_heads, 1, head_dim]``
    or None) and rotary embedding of ``x`` ``[R, T, H]``: returns ``q`` ``[R, heads, T, head_dim]`` and the
    new keys and values ``[R, kv_heads, T, head_dim]``."""
    rows, width = x.shape[:2]
    qkv = _linear(rms_norm(x, norm, eps, offset), qkv_weight, qkv_bias, deterministic)
    head_dim = qkv.shape[-1] // (num_heads + 2 * num_kv_heads)
    qk, v = qkv.view(rows, width, num_heads + 2 * num_kv_heads, head_dim).transpose(1, 2).split_with_sizes(
        (num_heads + num_kv_heads, num_kv_heads), dim=1)
    if qk_norm is not None:
        qk = rms_norm(qk, qk_norm, eps, offset)
    q, k = rotate(qk, cos, sin).split_with_sizes((num_heads, num_kv_heads), dim=1)
    return q, k, v


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float,
           gqa: bool, pair: bool, softcap: float | None = None, deterministic: bool = False) -> torch.Tensor:
    """Scaled dot-product attention of ``q`` ``[R, heads, T, head_dim]`` over ``keys`` and ``values``
    ``[R, kv_heads, K, head_dim]`` (``mask`` ``[R, 1, T, K]`` bool or None). ``pair`` (``T = 1`` only): the
    query is attended as two copies of itself and the first answer kept (see
    :data:`~.fast_llama.PAIR_SINGLE_QUERIES`). ``softcap``: scores become ``c * tanh(s / c)`` before the
    mask (Gemma 2), which SDPA cannot do: computed explicitly, softmax in float32 as transformers does.
    ``deterministic``: :func:`.deterministic.attend` (``pair`` is then moot)."""
    if deterministic:
        return det.attend(q, keys, values, mask, scale, softcap)
    if softcap is not None:
        return _softcapped(q, keys, values, mask, scale, softcap)
    if pair:
        q = torch.cat([q, q], dim=2)
        mask = None if mask is None else mask.expand(-1, -1, 2, -1)
    attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return attn[:, :, :1] if pair else attn


def _softcapped(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float,
                softcap: float) -> torch.Tensor:
    rows, heads, width, head_dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads  # query head h reads kv head h // group
    grouped = q.reshape(rows, kv_heads, group * width, head_dim)
    scores = torch.matmul(grouped, keys.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(rows, kv_heads, group, width, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(weights.view(rows, kv_heads, group * width, -1), values)
    return out.view(rows, heads, width, head_dim)


def attention_output(
    x: torch.Tensor, attn: torch.Tensor, o_weight: torch.Tensor, o_bias: torch.Tensor | None,
    out_norm: torch.Tensor | None, mlp_norm: torch.Tensor, eps: float, offset: bool, deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output projection (then the post-attention norm, if any) and residual, then the MLP's input norm.
    ``x`` ``[R, T, H]``, ``attn`` ``[R, heads, T, head_dim]``; returns the residual stream and the MLP's input."""
    rows, width = x.shape[:2]
    out = _linear(attn.transpose(1, 2).reshape(rows, width, -1), o_weight, o_bias, deterministic)
    if out_norm is not None:
        out = rms_norm(out, out_norm, eps, offset)
    x = x + out
    return x, rms_norm(x, mlp_norm, eps, offset)


def attention_output_and_mlp(
    x: torch.Tensor, attn: torch.Tensor, o_weight: torch.Tensor, o_bias: torch.Tensor | None,
    out_norm: torch.Tensor | None, mlp_norm: torch.Tensor, gate_up_weight: torch.Tensor,
    gate_up_bias: torch.Tensor | None, down_weight: torch.Tensor, down_bias: torch.Tensor | None,
    mlp_out_norm: torch.Tensor | None, eps: float, offset: bool, act: str, deterministic: bool = False,
) -> torch.Tensor:
    """The rest of a dense decoder layer: :func:`attention_output`, the gated MLP (``act(gate) * up``),
    its output norm if any, and the residual. ``x`` ``[R, T, H]``, ``attn`` ``[R, heads, T, head_dim]``."""
    x, h = attention_output(x, attn, o_weight, o_bias, out_norm, mlp_norm, eps, offset, deterministic)
    gate, up = _linear(h, gate_up_weight, gate_up_bias, deterministic).chunk(2, -1)
    out = _linear(activation(gate, act) * up, down_weight, down_bias, deterministic)
    if mlp_out_norm is not None:
        out = rms_norm(out, mlp_out_norm, eps, offset)
    return x + out


def decoder_layer(
    x: torch.Tensor, attention: tuple, output: tuple, cos: torch.Tensor, sin: torch.Tensor, key_pool: torch.Tensor,
    value_pool: torch.Tensor, written: torch.Tensor, attended: torch.Tensor, mask: torch.Tensor, eps: float,
    num_heads: int, num_kv_heads: int, gqa: bool, offset: bool, scale: float, softcap: float | None, act: str,
) -> torch.Tensor:
    """A whole dense decoder layer over a grid ``x`` ``[R, T, H]``, as one function for torch.compile to fuse
    (what a CUDA graph's forward runs): :func:`attention_inputs` (``attention`` its weights), the new keys and
    values written to pool storage rows ``written`` ``[R*T]`` of ``key_pool``/``value_pool`` ``[S, kv_heads,
    head_dim]`` (:func:`.grid.write_rows`), the attended entries gathered from ``attended`` ``[R*K]``
    (:func:`.grid.read_rows`), :func:`attend` under
    ``mask`` ``[R, 1, T, K]``, then :func:`attention_output_and_mlp` (``output`` its weights). ``gqa``: whether
    ``num_kv_heads < num_heads`` (a bool, not derived here: under dynamic shapes the head counts are symbolic)."""
    q, k, v = attention_inputs(x, *attention, cos, sin, eps, num_heads, num_kv_heads, offset)
    grid.write_rows(key_pool, written, k)
    grid.write_rows(value_pool, written, v)
    rows = x.shape[0]
    keys, values = grid.read_rows(key_pool, attended, rows), grid.read_rows(value_pool, attended, rows)
    attn = attend(q, keys, values, mask, scale, gqa, False, softcap)
    return attention_output_and_mlp(x, attn, *output, eps, offset, act)


def route(h: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk: bool, deterministic: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The router of a mixture of experts over tokens ``h`` ``[N, H]`` (``router`` ``[E, H]``): softmax in
    float32, the ``top_k`` most probable experts, renormalised over them if ``norm_topk``. Returns
    their weights (float32) and indices, ``[N, top_k]`` each."""
    probs = torch.softmax(_linear(h, router, None, deterministic), dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def _weighted(out: torch.Tensor, weights: torch.Tensor, float32_weights: bool) -> torch.Tensor:
    """An expert's output times its routing weight: Mixtral multiplies in float32 (then casts), Qwen3-MoE
    casts the weight to the model dtype first."""
    if float32_weights:
        return (out * weights).to(out.dtype)
    return out * weights.to(out.dtype)


def routed_experts(
    h: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int, norm_topk: bool,
    float32_weights: bool, act: str, deterministic: bool = False,
) -> torch.Tensor:
    """A mixture of experts over ``h`` ``[R, T, H]``: :func:`route`, then each token's experts (``gate_up``
    ``[E, 2 I, H]``, ``down`` ``[E, H, I]``) weighted and summed in ascending expert order, as transformers.
    Batched over the tokens: one loop over the experts that some token chose, each computing all of its
    tokens at once. It reads which experts were chosen on the host (one sync), so it cannot be captured
    in a CUDA graph; :func:`dense_experts` can."""
    shape = h.shape
    flat = h.reshape(-1, shape[-1])
    weights, experts = route(flat, router, top_k, norm_topk, deterministic)
    order = experts.flatten().argsort(stable=True)  # (token, choice) pairs grouped by expert
    counts = torch.bincount(experts.flatten(), minlength=gate_up.shape[0]).tolist()
    tokens, choice_weights = order // top_k, weights.flatten()[order]
    out = torch.zeros_like(flat)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            picked = tokens[start : start + count]
            gate, up = _linear(flat[picked], gate_up[expert], None, deterministic).chunk(2, -1)
            result = _linear(activation(gate, act) * up, down[expert], None, deterministic)
            out.index_add_(0, picked, _weighted(result, choice_weights[start : start + count, None], float32_weights))
            start += count
    return out.view(shape)


def dense_experts(
    h: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int, norm_topk: bool,
    float32_weights: bool, act: str,
) -> torch.Tensor:
    """:func:`routed_experts` with no host sync and static shapes (capturable in a CUDA graph): every
    expert runs on every token, an unchosen expert weighted by an exact zero. It computes ``E / top_k``
    times the chosen experts' work and reads every expert's weights once per forward (as a grouped
    product does once the tokens' choices cover the experts): the price of a captured step."""
    shape = h.shape
    flat = h.reshape(-1, shape[-1])
    weights, experts = route(flat, router, top_k, norm_topk)
    dense = torch.zeros(flat.shape[0], gate_up.shape[0], dtype=weights.dtype, device=flat.device)
    dense.scatter_(1, experts, weights)  # [N, E]
    gate, up = torch.matmul(flat, gate_up.transpose(1, 2)).chunk(2, -1)  # [E, N, I] each
    result = torch.matmul(activation(gate, act) * up, down.transpose(1, 2))  # [E, N, H]
    return _weighted(result, dense.t()[:, :, None], float32_weights).sum(0).view(shape)
