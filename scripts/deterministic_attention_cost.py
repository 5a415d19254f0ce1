"""What the deterministic mode's attention costs: ``deterministic.attend`` of this checkout against the one of an
earlier commit (``--baseline``), best of ``--repeats`` calls, at decoding, verification and prefill shapes in
bfloat16 (32 heads over 4 KV heads of 64, and over 8 KV heads of 128). With ``--model`` (a fast-backend model
folder, e.g. an inflated ``1b`` target), also ``LLM(..., deterministic=True)`` end to end: four 128-token prompts
prefilled, and one request of 128 + 32 tokens, median of 3. A benchmark, not a test:
``docs/lab-notes/2026-11-30-queue-weight.md`` used it.

    python scripts/deterministic_attention_cost.py --baseline e48104d
    python scripts/deterministic_attention_cost.py --baseline e48104d --model /tmp/inflate_1b/1b-*/target
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
import types
from pathlib import Path

import torch

from specdec.models import deterministic

ROOT = Path(__file__).resolve().parents[1]
CASES = ((1, 1, 1024), (16, 1, 1024), (16, 5, 1024), (64, 1, 512), (1, 512, 512), (4, 128, 256))
"""(rows, queries per row, keys): decoding, a verification of 5, a 512-token prefill, chunks of 128."""


def baseline_attend(rev: str):
    """``deterministic.attend`` as commit ``rev`` had it."""
    source = subprocess.run(["git", "show", f"{rev}:src/specdec/models/deterministic.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType(f"deterministic_{rev}")
    exec(compile(source, module.__name__, "exec"), module.__dict__)  # noqa: S102 - the repository's own history
    return module.attend


def best(fn, *args, repeats: int) -> float:
    fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def end_to_end(model: str) -> str:
    from specdec import LLM, SamplingParams

    llm = LLM(model, deterministic=True)
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 8000 + 10 for i in range(128)]} for j in range(16)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    gen = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], one)
    prefill, decode = [], []
    for r in range(3):
        start = time.perf_counter()
        llm.generate(prompts[4 * r + 4: 4 * r + 8], one)
        prefill.append(time.perf_counter() - start)
        start = time.perf_counter()
        llm.generate(prompts[:1], gen)
        decode.append(time.perf_counter() - start)
    return (f"four 128-token prompts prefilled {statistics.median(prefill):.2f} s; "
            f"a 128 + 32 token request {statistics.median(decode):.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=None, help="a commit whose attention is timed beside this checkout's")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--model", default=None, help="also time LLM(..., deterministic=True) on this model")
    cli = parser.parse_args()
    torch.manual_seed(0)
    attends = {"this checkout": deterministic.attend}
    if cli.baseline:
        attends[cli.baseline] = baseline_attend(cli.baseline)
    for heads, kv_heads, dim in ((32, 4, 64), (32, 8, 128)):
        for rows, width, keys in CASES:
            q = torch.randn(rows, heads, width, dim).bfloat16()
            k, v = torch.randn(2, rows, kv_heads, keys, dim).bfloat16().unbind(0)
            mask = torch.ones(rows, 1, width, keys, dtype=torch.bool).tril(keys - width)
            times = ", ".join(f"{name} {best(fn, q, k, v, mask, dim**-0.5, repeats=cli.repeats):.1f} ms"
                              for name, fn in attends.items())
            print(f"{heads} heads over {kv_heads} of {dim}, {rows} rows x {width} queries over {keys} keys: {times}")
    if cli.model:
        print(end_to_end(cli.model))


if __name__ == "__main__":
    main()
