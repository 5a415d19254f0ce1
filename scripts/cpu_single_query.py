"""One query per row on a CPU: torch's attention for a single query against the same query twice
(``PAIR_SINGLE_QUERIES`` in ``specdec.models.fast_llama``), on this machine: a benchmark, not a test.

Three measurements, each side by side in one process:

- ``attention``: ``scaled_dot_product_attention`` of one query per row, alone and as a pair, in each
  dtype, over several rows and cached lengths (microseconds, median of repeats, and whether the two
  answers are bit for bit the same);
- ``forward``: the embedded target's (or ``--draft``'s) one-token forward with pairing on and off;
- ``generate``: plain greedy decoding of held-out code prompts with pairing on and off, at each
  ``--rows`` prompts per call (calls alternate between the two, in rotating order).

    python scripts/cpu_single_query.py attention forward generate --rows 1 16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from specdec import LLM, SamplingParams
from specdec.assets import require_default_pair
from specdec.bench.workloads import PromptBuilder, load_workload
from specdec.models.base import ForwardBatch
from specdec.models.fast_llama import FastLlamaLM
from specdec.models.kv_pool import PagedKVPool
from specdec.models.layers import attend
from specdec.models.loader import load_causal_lm

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def median_us(fn: Callable[..., object], *args: object, calls: int = 50, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean microseconds of ``calls`` calls ``fn(*args)``, after a warm-up."""
    for _ in range(5):
        fn(*args)
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def attention(rows_list: list[int], heads: int, head_dim: int) -> None:
    print(f"| dtype | rows | keys | one query (us) | a pair (us) | ratio | same bits |\n|{' --- |' * 7}")
    for name, dtype in DTYPES.items():
        for rows in rows_list:
            for keys in (64, 256, 1024):
                q = torch.randn(rows, heads, 1, head_dim, dtype=dtype)
                k, v = (torch.randn(rows, heads, keys, head_dim, dtype=dtype) for _ in range(2))
                one = median_us(attend, q, k, v, None, head_dim**-0.5, False, False)
                two = median_us(attend, q, k, v, None, head_dim**-0.5, False, True)
                same = torch.equal(attend(q, k, v, None, 0.1, False, False), attend(q, k, v, None, 0.1, False, True))
                print(f"| {name} | {rows} | {keys} | {one:.0f} | {two:.0f} | {one / two:.2f} | {same} |")


def one_token_step(lm: FastLlamaLM, batch: ForwardBatch, cache: PagedKVPool, cached: int) -> None:
    """A one-token forward of every row after ``cached`` tokens (each slot rolled back to them first)."""
    for slot in batch.slots:
        cache.set_length(slot, cached)
    lm.forward(batch, cache)


def forward(lm: FastLlamaLM, rows_list: list[int]) -> None:
    print(f"| rows | cached | single (ms) | paired (ms) | single / paired |\n|{' --- |' * 5}")
    for rows in rows_list:
        for cached in (100, 400):
            cache = lm.new_cache(rows, cached + 8)
            fill = [[(7 * i + r) % lm.vocab_size for i in range(cached)] for r in range(rows)]
            lm.forward(ForwardBatch.from_rows(fill, [0] * rows, list(range(rows)), lm.device, logits="none"), cache)
            batch = ForwardBatch(torch.randint(0, lm.vocab_size, (rows,)), torch.full((rows,), cached),
                                 list(range(rows)), list(range(rows + 1)))
            times = {False: [], True: []}
            for _ in range(5):  # alternate, so that drift hits both alike
                for pair in (False, True):
                    lm.pair_single_queries = pair
                    times[pair].append(median_us(one_token_step, lm, batch, cache, cached, calls=10, repeats=1) / 1e3)
            single, paired = statistics.median(times[False]), statistics.median(times[True])
            print(f"| {rows} | {cached} | {single:.2f} | {paired:.2f} | {single / paired:.2f} |")


def generate(target: str, rows_list: list[int], num_prompts: int, max_tokens: int) -> None:
    print(f"| rows | single (tok/s) | paired (tok/s) | paired / single |\n|{' --- |' * 4}")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for rows in rows_list:
        llms = {pair: LLM(target, max_num_seqs=rows) for pair in (False, True)}
        for pair, llm in llms.items():
            llm.engine.target.pair_single_queries = pair
        builder = PromptBuilder(llms[False].tokenizer)
        prompts = [p for p in (builder.build(q.turns[:1], []) for q in load_workload("code", num_prompts=num_prompts))
                   if len(p) + max_tokens <= 512]
        seconds, tokens = {False: 0.0, True: 0.0}, {False: 0, True: 0}
        for pair in (False, True):  # warm-up
            llms[pair].generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=8))
        for i in range(0, len(prompts), rows):
            chunk = [{"prompt_token_ids": p} for p in prompts[i : i + rows]]
            for pair in ((False, True) if i // rows % 2 == 0 else (True, False)):
                start = time.perf_counter()
                outputs = llms[pair].generate(chunk, params)
                seconds[pair] += time.perf_counter() - start
                tokens[pair] += sum(len(o.outputs[0].token_ids) for o in outputs)
        single, paired = tokens[False] / seconds[False], tokens[True] / seconds[True]
        print(f"| {rows} | {single:.1f} | {paired:.1f} | {paired / single:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("measure", nargs="+", choices=["attention", "forward", "generate"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--draft", action="store_true", help="forward: the embedded draft instead of the target")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    target, draft = require_default_pair()
    lm = load_causal_lm(str(draft if args.draft else target), device="cpu")
    if "attention" in args.measure:
        attention(args.rows, lm.num_heads, lm.head_dim)
    if "forward" in args.measure:
        print(f"{lm.name} ({lm.dtype})")
        with torch.inference_mode():
            forward(lm, args.rows)
    if "generate" in args.measure:
        generate(str(target), args.rows, args.num_prompts, args.max_tokens)


if __name__ == "__main__":
    main()
