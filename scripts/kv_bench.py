"""Measurements of the paged KV pool (docs/lab-notes/2026-11-24-paged.md): plain decoding speed, the time
to first token of a chat's second turn with and without prefix caching, and a flood of short requests
through a pool sized for the concurrency.

    PYTHONPATH=src python3 scripts/kv_bench.py decode --batch 1 16
    PYTHONPATH=src python3 scripts/kv_bench.py random-model --out /tmp/llama-4k
    PYTHONPATH=src python3 scripts/kv_bench.py ttft --model /tmp/llama-4k --history 2000
    PYTHONPATH=src python3 scripts/kv_bench.py flood --requests 1000 --concurrency 64
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from specdec import LLM, SamplingParams
from specdec.assets import require_default_pair


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(n)]


def decode(args: argparse.Namespace) -> None:
    """Plain decoding of the embedded target at each batch size: tokens per second of wall time and of this
    process's CPU time (one thread; the CPU time is what a busy shared machine perturbs least), best of
    ``--repeats``."""
    torch.set_num_threads(args.threads)
    target, _ = require_default_pair()
    llm = LLM(str(target), max_num_seqs=max(args.batch), **_kv(args))
    vocab = llm.target.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    for batch in args.batch:
        prompts = [{"prompt_token_ids": _ids(args.prompt, vocab, i)} for i in range(batch)]
        llm.generate(prompts, params)  # warm-up
        wall = cpu = 0.0
        for _ in range(args.repeats):
            start, start_cpu = time.perf_counter(), time.process_time()
            llm.generate(prompts, params)
            wall = max(wall, batch * args.tokens / (time.perf_counter() - start))
            cpu = max(cpu, batch * args.tokens / (time.process_time() - start_cpu))
        print(f"batch {batch}: {wall:.1f} tokens/s wall, {cpu:.1f} tokens/s of CPU time (prompt {args.prompt}, "
              f"{args.tokens} new tokens per sequence, {args.threads} thread)", flush=True)


def ttft(args: argparse.Namespace) -> None:
    """One thread. A chat's second turn after a ``--history``-token first turn: seconds to the first token with and
    without prefix caching (the first turn runs in the same LLM first)."""
    torch.set_num_threads(1)
    for cache in (False, True):
        llm = LLM(args.model, max_num_seqs=1, max_model_len=args.history + 64, enable_prefix_caching=cache,
                  dtype=args.dtype, **_kv(args, prefix=False))
        vocab = llm.target.vocab_size
        history = _ids(args.history - 16, vocab, 0)
        first = llm.generate([{"prompt_token_ids": history}], SamplingParams(temperature=0.0, max_tokens=8))
        second = history + list(first[0].outputs[0].token_ids) + _ids(8, vocab, 1)
        times, cpu = [], []
        for _ in range(args.repeats):
            start, start_cpu = time.perf_counter(), time.process_time()
            next(iter(llm.stream({"prompt_token_ids": second}, SamplingParams(temperature=0.0, max_tokens=1))))
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        hits = llm.engine.cache.prefix_cache_counts()[1]
        print(f"prefix caching {'on ' if cache else 'off'}: second turn of {len(second)} tokens, TTFT "
              f"{min(times) * 1000:.1f} ms wall, {min(cpu) * 1000:.1f} ms of CPU time (best of {args.repeats}; "
              f"{hits} tokens found cached)", flush=True)


def flood(args: argparse.Namespace) -> None:
    """``--requests`` short requests through ``--concurrency`` slots with a pool sized (by ``kv_cache_memory``)
    for ``--concurrency`` sequences of ``--pool-tokens`` tokens: preemptions (should be 0) and throughput."""
    target, _ = require_default_pair()
    per_token = LLM(str(target), max_num_seqs=1).target.kv_bytes_per_token()
    budget = args.concurrency * args.pool_tokens * per_token
    llm = LLM(str(target), max_num_seqs=args.concurrency, max_model_len=args.max_model_len, kv_cache_memory=budget)
    vocab = llm.target.vocab_size
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": _ids(rng.randrange(8, 64), vocab, i)} for i in range(args.requests)]
    params = [SamplingParams(temperature=0.8, max_tokens=rng.randrange(4, args.max_tokens), seed=i)
              for i in range(args.requests)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    pool = llm.engine.cache
    print(f"{args.requests} requests at {args.concurrency} concurrency: {tokens} tokens in {seconds:.1f} s "
          f"({tokens / seconds:.0f} tokens/s); pool {pool.num_blocks} blocks of {pool.block_size}; preemptions "
          f"{llm.scheduler.num_preemptions}; blocks in use after {pool.num_used_blocks}")


def random_model(args: argparse.Namespace) -> None:
    """A random-weight Llama of a realistic shape whose context holds a long chat (cost only, no text)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 256), max_position_embeddings=4096,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(args.out)
    print(f"wrote {args.out}: {args.layers} layers of {args.hidden}, context 4096")


def _kv(args: argparse.Namespace, prefix: bool = True) -> dict:
    kv = {} if args.kv_cache_memory is None else {"kv_cache_memory": args.kv_cache_memory}
    if prefix and args.prefix_caching is not None:
        kv["enable_prefix_caching"] = args.prefix_caching
    return kv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-memory", default=None)
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("decode")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt", type=int, default=100)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=decode)
    p = sub.add_parser("ttft")
    p.add_argument("--model", required=True)
    p.add_argument("--history", type=int, default=2000)
    p.add_argument("--dtype", default="auto")
    p.set_defaults(func=ttft)
    p = sub.add_parser("random-model")
    p.add_argument("--out", required=True)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.set_defaults(func=random_model)
    p = sub.add_parser("flood")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512, help="the embedded pair's context is 512")
    p.add_argument("--pool-tokens", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=48)
    p.set_defaults(func=flood)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
