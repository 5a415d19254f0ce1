"""Resident memory over many requests of varying prompt lengths: a benchmark, not a test.

Runs ``--requests`` requests with random token-id prompts of 1..``--max-prompt`` tokens through
one ``LLM`` on the embedded target (default dtype: bf16 on a CPU that has it) and prints the
resident set size after the warm-up and then every ``--every`` requests, so that growth per
request (per-shape kernel state, leaks) shows.

    python scripts/memory_soak.py --requests 1000 --warmup 100

``--server``: starts ``specdec serve`` (the embedded pair, draft_model k=4) on a free loopback port
and runs ``--runs`` load runs of ``--streams`` streaming completions each (``--concurrency`` in
flight, ``--disconnect-fraction`` of them closed early by the client), printing after each run the
server's resident memory, the requests still running, the KV blocks still in use and the preemptions
so far; a greedy completion sent before the first run and after the last one must be identical.

    python scripts/memory_soak.py --server --runs 5 --streams 100 --concurrency 100   # 30% disconnect
    python scripts/memory_soak.py --server --runs 1 --streams 1000 --concurrency 64 --disconnect-fraction 0
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import subprocess
import sys
import time

from specdec import LLM, SamplingParams
from specdec.assets import require_default_pair


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def process_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def server_soak(args: argparse.Namespace) -> None:
    """Load runs against a ``specdec serve`` subprocess on 127.0.0.1; RSS of the server after each."""
    import httpx

    from specdec.server.loadgen import run_level, settle

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--host", "127.0.0.1", "--port",
                               str(port), "--log-level", "warning", "--max-num-seqs", str(args.concurrency)])
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            try:
                if httpx.get(root + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        rng = random.Random(0)
        words = ["the", "a", "cat", "sat", "on", "mat", "and", "then", "went", "to", "sleep", "while", "dog", "ran",
                 "far", "away"]
        prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 60))) for _ in range(200)]
        def greedy() -> str:
            body = {"prompt": "def fibonacci(n):", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
            return httpx.post(root + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]

        before = greedy()
        start = process_rss_mib(server.pid)
        print(f"server pid {server.pid}, started: {start:.0f} MiB", flush=True)
        for run in range(1, args.runs + 1):
            results, seconds = asyncio.run(run_level(root + "/v1", None, prompts, args.concurrency, args.streams,
                                                     args.stream_tokens, 0.8, {}, args.disconnect_fraction, rng))
            gauges = settle(root + "/v1", {})
            errors = sum(r.error is not None for r in results)
            rss = process_rss_mib(server.pid)
            print(f"run {run:2d}: {seconds:5.1f} s, {sum(r.tokens for r in results)} tokens, "
                  f"{sum(r.disconnected for r in results)} disconnected, {errors} errors, running "
                  f"{gauges.get('running', float('nan')):.0f}, KV usage {gauges.get('kv_usage', float('nan')):.3f}, "
                  f"preemptions {gauges.get('preemptions', float('nan')):.0f}, RSS {rss:.0f} MiB "
                  f"({100 * (rss / start - 1):+.1f}%)", flush=True)
        print(f"greedy completion identical before and after: {greedy() == before}", flush=True)
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--max-prompt", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--method", default="none", choices=["none", "ngram", "draft_model"])
    parser.add_argument("--server", action="store_true", help="soak a specdec serve process instead")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--disconnect-fraction", type=float, default=0.3)
    parser.add_argument("--stream-tokens", type=int, default=64, help="max_tokens of each stream (--server)")
    args = parser.parse_args()
    if args.server:
        server_soak(args)
        return
    target, draft = require_default_pair()
    config = None
    if args.method == "ngram":
        config = {"method": "ngram", "num_speculative_tokens": 4}
    elif args.method == "draft_model":
        config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}
    llm = LLM(str(target), dtype=args.dtype, speculative_config=config, max_num_seqs=4)
    vocab = llm.target.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"dtype {llm.target.dtype}, method {args.method}, start {resident_mib():.0f} MiB")
    base = None
    for i in range(1, args.requests + 1):
        n = rng.randrange(1, args.max_prompt + 1)
        llm.generate({"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(n)]}, params)
        if i == args.warmup:
            base = resident_mib()
            print(f"after warm-up ({i} requests): {base:.0f} MiB")
        elif i % args.every == 0 and base is not None:
            now = resident_mib()
            print(f"after {i} requests: {now:.0f} MiB ({100 * (now - base) / base:+.1f}% since warm-up)")


if __name__ == "__main__":
    main()
