"""float32 products with weights stored in bfloat16, for a CPU whose oneDNN has no bfloat16 kernel (AVX2).

A model whose checkpoint is bfloat16 runs in float32 on such a CPU (``--dtype auto``): its float32 weights hold
bfloat16 values, and a product reads 4 bytes a weight where 2 hold it. :func:`blocked` stores such a weight
``[out, in]`` as bfloat16 in blocks of 16 outputs (``[out / 16, in, 16]``, :data:`BLOCK`), and :func:`linear`
multiplies float32 rows by it with a kernel of this package (``bf16_product.cpp``: AVX2 and FMA, each bfloat16
widened exactly to float32 as it is read, float32 fused multiply-adds). So the products are float32 arithmetic
on the same weight values, the weights take half the memory, and a product over a few rows (plain decoding,
verification) reads half the bytes. Each output is one chain of multiply-adds over the inputs in order whatever
the row count, so a row's values do not depend on the rows beside it.

Which weights (:func:`blocked`): float32 on a CPU with AVX2 (:func:`available`), ``out`` a multiple of
:data:`BLOCK`, every value a bfloat16 (checked: a weight that is not is kept as it is, so nothing is rounded).
The kernel is compiled once per machine and torch version with the C++ compiler and ``ninja`` (about a minute;
cached under ``$TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``). Without a compiler (a line
says why), or with ``SPECDEC_BF16_PRODUCT=0``, such weights are packed for oneDNN in float32 as before
(:mod:`.cpu_linear`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

BLOCK = 16
"""Outputs per block of a stored weight ``[out / BLOCK, in, BLOCK]``."""
INTERLEAVE = torch.tensor([o for j in range(BLOCK // 2) for o in (j, BLOCK // 2 + j)])
"""The outputs of a block in the order of its 16 values per input: ``0, 8, 1, 9, ..., 7, 15`` (the 32-bit word
``j`` holds outputs ``j`` and ``8 + j``: the kernel widens a load with one shift and one mask)."""
ENV = "SPECDEC_BF16_PRODUCT"
"""Set to ``0`` to keep float32 weights in float32 (oneDNN's packed product)."""
SOURCE = Path(__file__).with_name("bf16_product.cpp")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]

log = logging.getLogger("specdec")
_lock = threading.Lock()
_kernel: object | None = None
_tried = False


def available() -> bool:
    """Whether this process runs :func:`linear`: a CPU with AVX2, not switched off by :data:`ENV`, and the kernel
    built (on the first call; a failure is logged once and answered False)."""
    global _kernel, _tried
    if _tried:
        return _kernel is not None
    with _lock:
        if not _tried:
            _kernel = _build()
            _tried = True
    return _kernel is not None


def _build() -> object | None:
    if os.environ.get(ENV, "1") == "0":
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the ninja wheel's binary, where pip put it off PATH
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:12]
    name = f"specdec_bf16_product_{digest}"
    try:
        built = (Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so").exists()
    except Exception:  # a private helper of torch's: only for the message
        built = False
    if not built:
        log.warning("specdec: building the bfloat16-weight product for this CPU (once; about a minute)")
    try:
        return cpp_extension.load(name, [str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                                  verbose=False)
    except Exception as exc:  # no compiler, no ninja, a failed build: the float32 product serves
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning("specdec: float32 weights stay float32 (the bfloat16-weight product could not be built: %s)",
                    first[:200])
        return None


def blocked(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` ``[out, in]`` stored as bfloat16 ``[out / BLOCK, in, BLOCK]`` (output ``BLOCK * b + o`` at
    ``[b, :, i]`` where ``INTERLEAVE[i] == o``: :data:`INTERLEAVE`, :func:`unblocked`) where it is float32 on the
    CPU, ``out`` a multiple of :data:`BLOCK`, every value a bfloat16, and :func:`available`; else None."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    out, width = weight.shape
    if out % BLOCK or weight.numel() == 0:
        return None
    weight = weight.detach()
    # the usual answer, from one row, before any build: a float32 checkpoint needs no compiler
    if not torch.equal(weight[0].to(torch.bfloat16).float(), weight[0]) or not available():
        return None
    values = weight.to(torch.bfloat16)
    if not torch.equal(values.float(), weight):
        return None
    return values.view(out // BLOCK, BLOCK, width)[:, INTERLEAVE].transpose(1, 2).contiguous()


def unblocked(weight: torch.Tensor) -> torch.Tensor:
    """The float32 ``[out, in]`` weight a :func:`blocked` one stores (exact)."""
    blocks, width, _ = weight.shape
    natural = torch.empty(blocks, BLOCK, width, dtype=torch.float32)
    natural[:, INTERLEAVE] = weight.transpose(1, 2).float()
    return natural.view(blocks * BLOCK, width)


def is_blocked(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a weight of :func:`blocked`."""
    return weight.dtype == torch.bfloat16 and weight.dim() == 3 and weight.shape[-1] == BLOCK


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for float32 ``x`` ``[..., in]`` and ``weight`` the :func:`blocked` ``W`` ``[out, in]``,
    ``bias`` ``[out]`` or None; returns float32 ``[..., out]``."""
    width = x.shape[-1]
    flat = x.reshape(-1, width)
    if flat.dtype != torch.float32:
        raise TypeError(f"a bfloat16-stored weight multiplies float32 rows, got {flat.dtype}")
    y = _kernel.blocked_linear(flat.contiguous(), weight)  # type: ignore[union-attr]
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], y.shape[-1])
