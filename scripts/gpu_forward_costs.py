"""Forward costs and decoding rates of the fast backend on a GPU, eager against CUDA graphs.

A benchmark, not a test (it needs a CUDA device). For each random-weight shape (``1b``,
``8b``: see :mod:`specdec.bench.synthetic`) it prints, side by side in one process:

- ``t(n)``: median time of one batch-1 target forward over ``n`` new tokens after a
  ``--context``-token prefix (CUDA events, rolled back after each), in each mode of :data:`MODES`
  (eager; graphs with the pieces around the attention compiled; graphs with whole dense layers
  compiled), and ``t(k+1)/t(1)``, the verification cost ratio;
- plain decoding through :class:`specdec.LLM` at batch 1 (and ``--batch`` for the 1b shape):
  tokens/s, and the fraction of the memory-bandwidth limit (weight bytes x steps/s over the
  bandwidth a read probe measures, or ``--bandwidth-gbs``);
- the target as its own draft (every draft accepted), k = 4: tokens/s over plain decoding
  against the ideal ``(k+1) / (k + t(k+1)/t(1))``.

    python scripts/gpu_forward_costs.py --shapes 1b 8b --tokens 256
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec import LLM, SamplingParams
from specdec.bench.hardware import measure_read_bandwidth_gbs, parameter_bytes
from specdec.bench.synthetic import build_synthetic
from specdec.models.base import ForwardBatch
from specdec.models.fast_llama import FastLlamaLM


def forward_ms(lm: FastLlamaLM, context: int, tokens: int, trials: int = 30) -> float:
    """Median milliseconds of one forward over ``tokens`` new tokens after ``context`` cached ones."""
    cache = lm.new_cache(1, context + tokens + 1)
    ids = torch.randint(0, lm.vocab_size, (context + tokens,), device=lm.device)
    lm.forward(ForwardBatch(ids[:context], torch.arange(context, device=lm.device), [0], [0, context],
                            logits_rows=ids.new_empty(0)), cache)
    batch = ForwardBatch(ids[context:], torch.arange(context, context + tokens, device=lm.device), [0], [0, tokens])
    times = []
    for _ in range(trials + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        lm.forward(batch, cache)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        cache.set_length(0, context)
    return statistics.median(times[3:])


def decode_rate(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    """Generated tokens per second over the whole batch (greedy, end-of-sequence ignored), timed on the second
    of two identical calls (``llm`` without prefix caching: with it, the timed call would skip the prefill the
    warm-up ran and meet shapes, graphs to capture, that the warm-up did not)."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)  # warm-up: captures every shape bucket
    torch.cuda.synchronize()
    tic = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    torch.cuda.synchronize()
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - tic)


def profile_steps(model, prompt: list[int], max_len: int) -> None:
    """Where a plain decoding step spends host time: torch profiler, top operations by self CPU time."""
    llm = LLM(model, max_num_seqs=1, max_model_len=max_len)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt}, params)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate({"prompt_token_ids": prompt}, params)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    del llm


MODES = {"eager": (False, False), "graphs": (True, False), "graphs+fused": (True, True)}
"""The forward modes compared: (CUDA graphs, dense layers compiled whole); ``graphs`` compiles only the pieces
around the attention (the backend before fused layers)."""


def backend(model, shape: str, mode: str) -> FastLlamaLM:
    graphs, fused = MODES[mode]
    return FastLlamaLM(model, f"synthetic-{shape}", use_cuda_graphs=graphs, fuse_layers=fused)


def plain_llm(model, mode: str, rows: int, max_len: int) -> LLM:
    """An ``LLM`` for plain decoding in ``mode`` (its backend's ``fuse_layers`` set for this run)."""
    graphs, fused = MODES[mode]
    llm = LLM(model, max_num_seqs=rows, max_model_len=max_len, enforce_eager=not graphs, enable_prefix_caching=False)
    llm.target.fuse_layers = fused
    return llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1b", "8b"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32, help="the 1b shape's batched plain decoding (0: skip)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--bandwidth-gbs", type=float, default=None,
                        help="the limit's bandwidth (default: measured by a read probe on the device)")
    parser.add_argument("--profile", action="store_true",
                        help="also print the host-side operations of 64 plain decoding steps (1b, graphs)")
    args = parser.parse_args()
    device = torch.device("cuda")
    bandwidth = args.bandwidth_gbs or measure_read_bandwidth_gbs(device)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; bandwidth {bandwidth:.0f} GB/s "
          f"({'given' if args.bandwidth_gbs else 'measured read probe'})")
    rows = []
    best = args.modes[-1]
    for shape in args.shapes:
        model = build_synthetic(shape, torch.bfloat16, device)
        max_len = args.context + args.tokens + args.k + 8
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, model.config.vocab_size, (args.context,), generator=gen).tolist()
        costs = {}
        for mode in args.modes:
            lm = backend(model, shape, mode)
            costs[mode] = {n: forward_ms(lm, args.context, n) for n in (1, args.k + 1)}
            del lm
        # Weights one step reads: everything but the embedding table (the synthetic shapes are untied).
        embedding = model.get_input_embeddings().weight
        weight_bytes = parameter_bytes(model) - embedding.numel() * embedding.element_size()
        torch.cuda.empty_cache()
        rates = {}
        for mode in args.modes:
            llm = plain_llm(model, mode, 1, max_len)
            rates[mode] = decode_rate(llm, [prompt], args.tokens)
            del llm
            torch.cuda.empty_cache()
        limit = bandwidth * 1e9 / weight_bytes
        for mode in args.modes:
            t1, tk = costs[mode][1], costs[mode][args.k + 1]
            rows.append(f"| {shape} | {mode} | {t1:.2f} | {tk:.2f} | {tk / t1:.2f} | {rates[mode]:.1f} | "
                        f"{1000 / rates[mode] - t1:.2f} | {limit:.0f} | {100 * rates[mode] / limit:.0f}% |")
            print(rows[-1], flush=True)
        if shape == "1b" and args.profile:
            profile_steps(model, prompt, max_len)
        if shape == "1b" and args.batch:
            prompts = [torch.randint(0, model.config.vocab_size, (args.context,), generator=gen).tolist()
                       for _ in range(args.batch)]
            llm = plain_llm(model, best, args.batch, max_len)
            batched = decode_rate(llm, prompts, args.tokens)
            del llm
            torch.cuda.empty_cache()
            print(f"1b plain, {best}: batch 1 {rates[best]:.1f} tok/s, batch {args.batch} {batched:.1f} tok/s "
                  f"({batched / rates[best]:.1f}x)")
            spec = {"method": "draft_model", "model": model, "num_speculative_tokens": args.k}
            llm = LLM(model, speculative_config=spec, max_num_seqs=1, max_model_len=max_len,
                      enable_prefix_caching=False)
            llm.target.fuse_layers = MODES[best][1]
            same = decode_rate(llm, [prompt], args.tokens)
            del llm
            torch.cuda.empty_cache()
            t1, tk = costs[best][1], costs[best][args.k + 1]
            ideal = (args.k + 1) / (args.k + tk / t1)
            print(f"1b draft = target, k={args.k}: {same:.1f} tok/s, {same / rates[best]:.2f}x plain; "
                  f"ideal {ideal:.2f}x; {100 * same / rates[best] / ideal:.0f}% of ideal")
        del model
        torch.cuda.empty_cache()
    print("| shape | mode | t(1) ms | t(k+1) ms | ratio | plain tok/s (batch 1) | step - t(1) ms | "
          "bandwidth limit tok/s | of limit |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
