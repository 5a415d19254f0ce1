"""What the hardware allows, measured beside the benchmark runs.

- the device's memory read bandwidth, measured (:func:`measure_read_bandwidth_gbs`: a reduction over a
  buffer far beyond the last-level cache on the threads the bench uses, or a read kernel on a GPU;
  best of a few), beside the spec-sheet figure of known GPUs (:func:`device_bandwidth_gbs`);
- the bytes one plain decoding step reads (:func:`step_read_bytes`: every weight a forward reads, the
  output head included, and the KV cache at a context length), whose ratio to the bandwidth is the
  least time of a step: the roofline;
- :func:`forward_seconds`: the time of one target forward over ``n`` new tokens at batch 1 after a
  cached context, on the model contract (own one-slot pool, rolled back between trials);
- the cost ratio c measured directly, and the ideal speedup of a draft equal to the target.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specdec.bench.summary import ideal_ratio
from specdec.errors import SpecDecError
from specdec.models.base import CausalLM, ForwardBatch

if TYPE_CHECKING:
    from specdec.llm import LLM

BANDWIDTH_GBS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H200",), 4800.0),
    (("H100", "PCIe"), 2000.0),
    (("H100", "NVL"), 3900.0),
    (("H100",), 3350.0),  # SXM (HBM3)
)
"""Peak memory bandwidth (GB/s) by the words of ``torch.cuda.get_device_name``; first match wins."""


def device_bandwidth_gbs(device: torch.device) -> float | None:
    """The peak memory bandwidth of ``device`` from :data:`BANDWIDTH_GBS`; None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for words, gbs in BANDWIDTH_GBS:
        if all(word in name for word in words):
            return gbs
    return None


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters (tied weights counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


CPU_PROBE_BYTES = 512 * 2**20
"""The CPU probe's buffer: far beyond any last-level cache."""
GPU_PROBE_BYTES = 2 * 2**30


def measure_read_bandwidth_gbs(device: torch.device, num_bytes: int | None = None, trials: int = 5) -> float:
    """The memory read bandwidth of ``device`` in GB/s, measured: the best of ``trials`` sums over a float32
    buffer of ``num_bytes`` (default :data:`CPU_PROBE_BYTES` / :data:`GPU_PROBE_BYTES`) after one warm-up, on
    the CPU with the threads torch uses now (those the bench runs on), on a GPU timed with CUDA events."""
    size = num_bytes or (GPU_PROBE_BYTES if device.type == "cuda" else CPU_PROBE_BYTES)
    buffer = torch.ones(size // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for trial in range(trials + 1):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            buffer.sum()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            tic = time.perf_counter()
            buffer.sum()
            seconds = time.perf_counter() - tic
        if trial:
            best = min(best, seconds)
    read = buffer.numel() * buffer.element_size()
    del buffer
    return read / best / 1e9


def step_read_bytes(model: torch.nn.Module, context_len: int) -> tuple[int, int]:
    """``(weight bytes, KV bytes)`` one plain decoding step of a transformers causal LM reads at batch 1:
    every parameter but an untied input embedding (of which it reads one row), so the output head is
    counted, and the keys and values of ``context_len`` cached tokens in every layer (model dtype)."""
    weights = parameter_bytes(model)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is not None and embed.weight is not head.weight:
        weights -= (embed.weight.shape[0] - 1) * embed.weight[0].numel() * embed.weight.element_size()
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    layers = getattr(config, "num_hidden_layers", None)
    if not heads or not layers:
        return weights, 0
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    element = next(model.parameters()).element_size()
    return weights, 2 * layers * kv_heads * head_dim * context_len * element


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_seconds(lm: CausalLM, context_ids: Sequence[int], num_tokens: int = 1, trials: int = 20) -> float:
    """Median wall-clock seconds of one forward of ``lm`` over ``num_tokens`` new tokens (batch 1, all
    their logits) after ``context_ids`` is cached; two untimed warm-up forwards first.

    The forward runs on a one-slot pool of its own (``len(context_ids) + num_tokens`` tokens); after
    each trial the slot is rolled back to the context. The new tokens repeat the context's last one.
    """
    if not context_ids or num_tokens < 1:
        raise SpecDecError("timing a forward needs a non-empty context and at least one new token")
    context = list(context_ids)
    cache = lm.new_cache(1, len(context) + num_tokens)
    lm.forward(ForwardBatch.from_rows([context], [0], [0], lm.device, logits="none"), cache)
    step = ForwardBatch.from_rows([[context[-1]] * num_tokens], [len(context)], [0], lm.device)
    times = []
    for trial in range(trials + 2):
        synchronize(lm.device)
        tic = time.perf_counter()
        lm.forward(step, cache)
        synchronize(lm.device)
        if trial >= 2:
            times.append(time.perf_counter() - tic)
        cache.set_length(0, len(context))
    return statistics.median(times)


def direct_cost_ratio(llm: LLM, context_ids: Sequence[int], trials: int = 20) -> float:
    """c measured directly: one forward of ``llm``'s draft model over one forward of its target, each a
    single token after ``context_ids`` (median of ``trials``). ``llm``'s drafter must have a ``model``."""
    draft = getattr(llm.engine.drafter, "model", None)
    if not isinstance(draft, CausalLM):
        raise SpecDecError("a directly measured cost ratio needs a speculative configuration with a draft model")
    return forward_seconds(draft, context_ids, 1, trials) / forward_seconds(llm.target, context_ids, 1, trials)


def draft_equals_target_ideals(
    target: CausalLM, context_ids: Sequence[int], ks: dict[str, int], trials: int = 20
) -> tuple[dict[int, float], dict[str, float]]:
    """For methods whose draft is the target itself (``ks``: label -> k), the forward times
    ``t(n)`` (n -> seconds; n = 1 and each k+1) and the ideal ratio ``(k+1) / (k + t(k+1)/t(1))`` per label."""
    sizes = sorted({1, *(k + 1 for k in ks.values())})
    seconds = {n: forward_seconds(target, context_ids, n, trials) for n in sizes}
    return seconds, {label: ideal_ratio(k, seconds[1], seconds[k + 1]) for label, k in ks.items()}
