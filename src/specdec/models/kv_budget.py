"""How many blocks the paged KV pools get: from a size (``kv_cache_memory``) or from a share of the device's
memory (``gpu_memory_utilization``, vLLM's name and meaning; on a CPU, a share of the machine's memory).

Terms:

- *the pools*: the target's paged pool and what else is sized by its blocks: a draft model's pool, which holds
  as many tokens (slot for slot the target's, :class:`~specdec.drafters.draft_lm.DraftLM`), and with prefix
  caching the target's hidden states kept beside its blocks for a drafter that reads them
  (:class:`~specdec.models.prefix_cache.BlockFeatures`, :func:`feature_bytes_per_token`).
- *bytes per token*: one token's keys and values in a pool, every layer
  (:meth:`~specdec.models.base.CausalLM.kv_bytes_per_token`).
- *in use*: what this process holds now, the models' weights among it: memory reserved by torch's CUDA
  allocator on a GPU, the resident set on a CPU.
- *step reserve*: an estimate of a step's transient memory, which the share must leave free: the activations
  of ``step_tokens`` tokens through one layer, the float32 logits of ``logit_rows`` rows, and one layer's keys
  and values gathered for attention (:func:`step_reserve`).

With ``gpu_memory_utilization`` = f, the pools take ``f * total - in use - step reserve`` bytes, measured
when the first pool is sized: after the target's and the drafter's weights are loaded, before either pool is
allocated (:meth:`KVBudget.blocks` is called by the drafter building its pool, else by the engine). What the
estimate misses (CUDA graphs' pools, the CUDA context, other processes) is left to the other ``1 - f``.
"""

from __future__ import annotations

import math
import os

import torch

from specdec.errors import SpecDecError
from specdec.models.base import GIB, POOL_MEMORY_FRACTION, CausalLM, available_memory
from specdec.models.kv_pool import BLOCK_SIZE

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


def parse_memory(value: int | str) -> int:
    """Bytes of a memory size: an int, or a string such as ``"4GiB"``, ``"512MiB"``, ``"2GB"``, ``"1e9"``."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(number):]
        try:
            size = float(number) * _UNITS[unit]
        except (ValueError, KeyError):
            size = 0
        if size >= 1:
            return int(size)
    raise SpecDecError(f"kv_cache_memory must be a positive size such as 4GiB, 512MiB or a number of bytes, "
                       f"got {value!r}")


def check_utilization(value: object) -> float:
    """``gpu_memory_utilization`` as a float in (0, 1], or :class:`SpecDecError` naming the bad value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise SpecDecError(f"gpu_memory_utilization must be a fraction in (0, 1], such as 0.9, got {value!r}")
    return float(value)


def device_memory(device: torch.device) -> tuple[int, int]:
    """(total, in use by this process) bytes of ``device``: the GPU's memory and torch's reserved memory on
    CUDA; on a CPU the machine's memory (or the cgroup's limit, when lower) and the resident set."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1], torch.cuda.memory_reserved(device)
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    try:
        with open("/sys/fs/cgroup/memory.max") as limit:
            text = limit.read().strip()
        if text.isdigit():
            total = min(total, int(text))
    except OSError:
        pass
    with open("/proc/self/statm") as statm:
        resident = int(statm.read().split()[1]) * page
    return total, resident


def _text_config(target: CausalLM):
    config = getattr(target, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def feature_bytes_per_token(target: CausalLM, layers: int) -> int:
    """Bytes one token's hidden states of ``layers`` target layers take, in the target's dtype."""
    return layers * (getattr(_text_config(target), "hidden_size", 0) or 0) * target.dtype.itemsize


def step_reserve(target: CausalLM, step_tokens: int, logit_rows: int) -> int:
    """Bytes a step's transient tensors may take (an estimate, see the module's docstring): ``step_tokens``
    tokens' activations through one layer (the residual, its norm, the attention's inputs and output: four
    widths of ``hidden_size``; the MLP's gate, up and product: three of ``intermediate_size``) in the model's
    dtype, and ``logit_rows`` rows of float32 logits, probabilities and sampling scratch."""
    text = _text_config(target)
    hidden = getattr(text, "hidden_size", 0) or 0
    intermediate = getattr(text, "intermediate_size", None) or 4 * hidden
    activations = step_tokens * (4 * hidden + 3 * intermediate) * target.dtype.itemsize
    return activations + 3 * logit_rows * target.vocab_size * 4


class KVBudget:
    """The blocks of the pools (see the module's docstring), fixed by the first :meth:`blocks` call.

    ``kv_cache_memory``: bytes (or ``"4GiB"``) of the target's pool; a draft model's pool holds as many
    tokens beside it. ``gpu_memory_utilization``: the share of the device's memory that the weights, the
    pools and a step (``step_tokens`` tokens fed, ``logit_rows`` rows scored) may take together. Neither:
    the pools' default sizing (every slot can be full). A target whose backend does not page its pool
    (transformers' forward: its caches grow per sequence) refuses both, rather than leave the memory unbounded
    while a limit was asked for.
    """

    def __init__(self, target: CausalLM, max_model_len: int, kv_cache_memory: int | str | None = None,
                 gpu_memory_utilization: float | None = None, step_tokens: int = 0, logit_rows: int = 0) -> None:
        self.memory, self.utilization = self.check(kv_cache_memory, gpu_memory_utilization)
        self.given = kv_cache_memory
        self.target, self.max_model_len = target, max_model_len
        self.step_tokens, self.logit_rows = step_tokens, logit_rows
        self.per_token = target.kv_bytes_per_token()
        if self.per_token is None and (self.memory is not None or self.utilization is not None):
            name = "kv_cache_memory" if self.memory is not None else "gpu_memory_utilization"
            raise SpecDecError(f"{name} sizes the fast backend's paged KV pool, and {target.name!r} runs on "
                               f"transformers' forward, whose caches grow per sequence (admitted by max_num_seqs "
                               f"alone): leave {name} out, or run a model the fast backend runs")
        self._blocks: int | None = None
        self.description: str | None = None  # how the share was spent, once sized (for the server's log)

    @staticmethod
    def check(kv_cache_memory: int | str | None, gpu_memory_utilization: float | None) -> tuple[int | None,
                                                                                               float | None]:
        """The size in bytes and the share, checked (:class:`SpecDecError` for a bad one, or both given)."""
        if kv_cache_memory is not None and gpu_memory_utilization is not None:
            raise SpecDecError("give kv_cache_memory (a size) or gpu_memory_utilization (a share), not both")
        return (None if kv_cache_memory is None else parse_memory(kv_cache_memory),
                None if gpu_memory_utilization is None else check_utilization(gpu_memory_utilization))

    def blocks(self, extra_bytes_per_token: int = 0) -> int | None:
        """Blocks each pool gets (None: the default sizing). The first call fixes them: a drafter building a
        pool beside the target's passes its bytes per token, the engine's call those of the features kept with
        the blocks (:func:`feature_bytes_per_token`), which the share then covers too."""
        if self.per_token is None or (self.memory is None and self.utilization is None):
            return None
        if self._blocks is None:
            self._blocks = (self._of_size() if self.memory is not None
                            else self._of_share(extra_bytes_per_token))
        return self._blocks

    def describe(self, num_blocks: int, num_slots: int) -> str | None:
        """How the target's pool of ``num_blocks`` blocks was sized, in a line (None on a backend that does not page
        its pool): from the share (as :meth:`blocks` spent it), from ``kv_cache_memory``, or room for ``num_slots``
        full sequences."""
        if self.description is not None or self.per_token is None:
            return self.description
        size = f"{num_blocks * BLOCK_SIZE} tokens ({num_blocks} blocks of {BLOCK_SIZE}, " \
               f"{num_blocks * BLOCK_SIZE * self.per_token / GIB:.2f} GiB)"
        if self.memory is not None:
            return f"kv_cache_memory {self.given}: the KV cache holds {size}"
        return (f"the KV cache holds {size}: room for max_num_seqs {num_slots} sequences of max_model_len "
                f"{self.max_model_len} (kv_cache_memory or gpu_memory_utilization size it instead)")

    def _of_size(self) -> int:
        blocks = self.memory // (self.per_token * BLOCK_SIZE)
        if blocks * BLOCK_SIZE < self.max_model_len:
            raise SpecDecError(
                f"kv_cache_memory {self.given} holds {blocks * BLOCK_SIZE} tokens of {self.target.name!r} "
                f"({self.per_token} bytes per token), fewer than one sequence of max_model_len {self.max_model_len}; "
                f"raise it to at least {self._sequence_blocks() * BLOCK_SIZE * self.per_token} bytes or lower "
                f"max_model_len")
        return blocks

    def _of_share(self, extra_bytes_per_token: int) -> int:
        total, in_use = device_memory(self.target.device)
        reserve = step_reserve(self.target, self.step_tokens, self.logit_rows)
        # Attention gathers one layer's keys and values of the tokens it reads: a layer's share of the pool.
        per_token = self.per_token * (1 + 1 / max(self.target.num_layers, 1)) + extra_bytes_per_token
        share = self.utilization * total
        budget = share - in_use - reserve
        blocks = max(0, math.floor(budget / (per_token * BLOCK_SIZE)))
        spent = (f"gpu_memory_utilization {self.utilization:g} of {total / GIB:.2f} GiB is {share / GIB:.2f} GiB, "
                 f"less {in_use / GIB:.2f} GiB in use (the weights and the rest) and {reserve / GIB:.2f} GiB kept "
                 f"for a step")
        if blocks < self._sequence_blocks():
            raise SpecDecError(
                f"{spent}: {max(budget, 0) / GIB:.2f} GiB for the KV cache, room for {blocks * BLOCK_SIZE} tokens, "
                f"fewer than one sequence of max_model_len {self.max_model_len}; raise gpu_memory_utilization or "
                f"lower max_model_len, max_num_seqs or max_num_batched_tokens")
        pools = blocks * BLOCK_SIZE * (self.per_token + extra_bytes_per_token)
        available = available_memory(self.target.device)
        if pools > POOL_MEMORY_FRACTION * available:
            fits = math.floor((in_use + reserve + POOL_MEMORY_FRACTION * available) / total * 100) / 100
            raise SpecDecError(
                f"{spent}: the KV cache would take {pools / GIB:.2f} GiB, but {available / GIB:.2f} GiB of "
                f"{self.target.device.type} memory is free (other processes hold the rest) and a pool may take "
                f"{POOL_MEMORY_FRACTION:.0%} of it; lower gpu_memory_utilization to at most {fits:g}")
        self.description = (f"{spent}: the KV cache holds {blocks * BLOCK_SIZE} tokens ({blocks} blocks of "
                            f"{BLOCK_SIZE}, {pools / GIB:.2f} GiB)")
        return blocks

    def _sequence_blocks(self) -> int:
        return -(-self.max_model_len // BLOCK_SIZE)
