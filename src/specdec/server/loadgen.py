"""``specdec bench-serve``: a load generator for a running ``specdec serve`` (or any OpenAI server);
``--in-process``: the serving benchmark of :mod:`specdec.bench.serving` (no server).

At each concurrency ``c`` it keeps ``c`` streaming ``/v1/completions`` requests in flight until
``--num-requests`` are done (a closed loop; with ``--request-rate`` the levels are request rates instead, the
requests arriving at random at that rate whatever is in flight: an open loop), and reports throughput
(generated tokens / wall time), time to first token and inter-token latency (p50, p99, mean). Token counts
come from vLLM's ``stream_options.continuous_usage_stats``: a chunk carrying ``m`` new tokens ``g`` seconds
after the previous one counts ``m`` inter-token latencies of ``g / m`` (the first chunk's tokens are covered
by the time to first token), so the mean is the time per output token.

``--disconnect-fraction`` makes that share of the requests (chosen at random) close their
connection after a random number of chunks: the soak test. ``/metrics`` is read before and
after each run (running requests, resident memory of the server process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.bench.arrivals import check_rates, poisson_arrivals
from specdec.cli_checks import check_output_file, number
from specdec.errors import SpecDecError
from specdec.inflate.pair import add_shape_flags


@dataclass
class Result:
    """One request as the client saw it."""

    tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    disconnected: bool = False
    error: str | None = None


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation; nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def recorded_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The flags of a run as a JSON record keeps them (plain values, anything else as its text), the API key
    left out: a record is shared, a key is not."""
    return {k: "<given, not recorded>" if k == "api_key" and v else
            v if isinstance(v, (int, float, str, list, type(None))) else str(v)
            for k, v in vars(args).items() if k != "func"}


def latencies(ttft_ms: list[float], itl_ms: list[float]) -> dict[str, float]:
    """TTFT and ITL p50, p99 and mean (milliseconds; nan when empty), under the rows' key names."""
    return {"ttft_ms_p50": percentile(ttft_ms, 50), "ttft_ms_p99": percentile(ttft_ms, 99),
            "ttft_ms_mean": statistics.fmean(ttft_ms) if ttft_ms else float("nan"),
            "itl_ms_p50": percentile(itl_ms, 50), "itl_ms_p99": percentile(itl_ms, 99),
            "itl_ms_mean": statistics.fmean(itl_ms) if itl_ms else float("nan")}


async def one_request(client, url: str, body: dict[str, Any], headers: dict[str, str],
                      disconnect_after: int | None) -> Result:
    """Stream one completion; close the connection after ``disconnect_after`` chunks when given."""
    result, start = Result(), time.perf_counter()
    last = start
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if not chunk.get("choices") or not chunk.get("usage"):
                    continue
                now = time.perf_counter()
                new = chunk["usage"]["completion_tokens"] - result.tokens
                if new > 0:
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.extend([(now - last) / new] * new)
                    last = now
                    result.tokens += new
                chunks += 1
                if disconnect_after is not None and chunks >= disconnect_after:
                    result.disconnected = True
                    return result
    except Exception as exc:  # a load generator reports failures, it does not stop at the first
        result.error = f"{type(exc).__name__}: {exc}"
    result.latency = time.perf_counter() - start
    return result


async def run_level(base_url: str, model: str | None, prompts: list[str], concurrency: int, num_requests: int,
                    max_tokens: int, temperature: float, headers: dict[str, str], disconnect_fraction: float,
                    rng: random.Random, arrivals: list[float] | None = None, first: int = 0
                    ) -> tuple[list[Result], float]:
    """``num_requests`` requests of the prompts from number ``first`` on (cycled), ``concurrency`` in flight (a
    closed loop), or with ``arrivals`` each sent that many seconds after the start however many are in flight (an
    open loop, :mod:`specdec.bench.arrivals`); returns the results and the wall time."""
    import httpx

    url = base_url.rstrip("/") + "/completions"
    plan = [(prompts[(first + i) % len(prompts)], rng.randint(1, 4) if rng.random() < disconnect_fraction else None)
            for i in range(num_requests)]
    results: list[Result] = []
    connections = (num_requests if arrivals is not None else concurrency) + 4
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        queue: asyncio.Queue = asyncio.Queue()
        for item in plan:
            queue.put_nowait(item)

        async def send(prompt: str, disconnect_after: int | None) -> None:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            if model:
                body["model"] = model
            results.append(await one_request(client, url, body, headers, disconnect_after))

        async def worker() -> None:
            while not queue.empty():
                await send(*queue.get_nowait())

        async def at(seconds: float, item: tuple[str, int | None]) -> None:
            await asyncio.sleep(max(0.0, tic + seconds - time.perf_counter()))
            await send(*item)

        tic = time.perf_counter()
        if arrivals is None:
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            await asyncio.gather(*(at(seconds, item) for seconds, item in zip(arrivals, plan)))
        return results, time.perf_counter() - tic


def level(row: dict[str, Any]) -> str:
    """A row's load: ``c=4`` (four clients in a closed loop) or ``0.5/s`` (requests arriving at that rate)."""
    rate = row.get("request_rate")
    return f"{rate:g}/s" if rate is not None else f"c={row['concurrency']}"


def summarize(results: list[Result], seconds: float, concurrency: int | None,
              request_rate: float | None = None) -> dict[str, Any]:
    """Throughput and latency percentiles of one level, ``concurrency`` clients or requests arriving at
    ``request_rate`` a second (latencies in milliseconds)."""
    done = [r for r in results if not r.error and not r.disconnected]
    ttft = [r.ttft * 1000 for r in done if r.ttft is not None]
    itl = [x * 1000 for r in done for x in r.itl]
    tokens = sum(r.tokens for r in results)
    return {
        "concurrency": concurrency, "request_rate": request_rate, "requests": len(results), "completed": len(done),
        "disconnected": sum(r.disconnected for r in results), "errors": sum(r.error is not None for r in results),
        "first_errors": [r.error for r in results if r.error][:3], "seconds": seconds, "tokens": tokens,
        "tokens_per_second": tokens / seconds if seconds else 0.0, "requests_per_second": len(done) / seconds,
        **latencies(ttft, itl),
    }


def scrape(base_url: str, headers: dict[str, str]) -> dict[str, float]:
    """Running/waiting requests, the server's resident memory, its KV-cache usage (0 to 1) and preemptions so
    far, from its ``/metrics``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    root = base_url.rstrip("/").removesuffix("/v1")
    text = httpx.get(root + "/metrics", headers=headers, timeout=30).text
    wanted = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
              "process_resident_memory_bytes": "rss_bytes", "vllm:kv_cache_usage_perc": "kv_usage",
              "vllm:num_preemptions_total": "preemptions"}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out[wanted[sample.name]] = out.get(wanted[sample.name], 0.0) + sample.value
    return out


def settle(base_url: str, headers: dict[str, str], timeout: float = 30.0) -> dict[str, float]:
    """``scrape`` until no request runs or waits (or ``timeout`` seconds passed)."""
    deadline = time.monotonic() + timeout
    while True:
        state = scrape(base_url, headers)
        if (state.get("running", 0) == 0 and state.get("waiting", 0) == 0) or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench-serve", help="load-test a running specdec serve (throughput, TTFT, ITL)",
        description="Send streaming completions to a running server at several concurrency levels and report "
        "throughput, time to first token and inter-token latency; --disconnect-fraction makes it a soak test.",
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    p.add_argument("--model", help="model name to send (default: none, the server's own)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64], help="levels (default 1 4 16 64)")
    p.add_argument("--num-requests", type=number(int, 1), default=None,
                   help="requests per level (default: 2 x concurrency, at least 8; at a request rate, 2 x the "
                   "largest concurrency level)")
    p.add_argument("--request-rate", type=float, nargs="+", default=None, metavar="RATE",
                   help="open loop: the levels are request rates instead of concurrencies (the code workload with "
                   "--in-process), --num-requests requests arriving at random (a Poisson process, seeded by "
                   "--seed, the same for every method) at RATE a second on average, whatever is in flight")
    p.add_argument("--max-tokens", type=number(int, 1), default=32, help="tokens per request (ignore_eos; default 32)")
    p.add_argument("--temperature", type=number(float, 0), default=0.0, help="default 0 (greedy)")
    p.add_argument("--num-prompts", type=number(int, 1), default=None,
                   help="held-out code prompts to send in turn (default: one per request of the run, warm-up "
                   "included, so that none is sent twice while the corpus lasts: a server's cross-request cache, "
                   "as suffix keeps, would otherwise be measured on outputs it has seen); not with --in-process")
    p.add_argument("--warmup", type=number(int, 0), default=None,
                   help="requests sent before measuring (default 2); not with --in-process, which warms up itself")
    p.add_argument("--disconnect-fraction", type=number(float, 0, 1), default=None,
                   help="share of requests that disconnect after 1-4 chunks (default 0); not with --in-process")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt order and of the disconnects")
    p.add_argument("--json", type=Path, help="also write the results to this JSON file")
    g = p.add_argument_group("in-process serving benchmark (--in-process: no server; the embedded pair, one "
                             "method at a time, through the server's own submit/step loop)")
    g.add_argument("--in-process", action="store_true",
                   help="drive the engine in this process instead of a server at --base-url")
    g.add_argument("--methods", default="plain,draft_model,eagle,suffix",
                   help="comma-separated methods (default plain,draft_model,eagle,suffix)")
    g.add_argument("--workloads", default="code,chat,flood",
                   help="comma-separated: code (single turn), chat (multi-turn, shared prefix), flood (long "
                   "prompts arriving beside running streams) (default all)")
    g.add_argument("--k", default="auto", type=lambda v: v if v == "auto" else int(v),
                   help="num_speculative_tokens of the speculative methods (default auto)")
    g.add_argument("--max-step-time-ratio", type=float, default=None, metavar="RATIO",
                   help="with --k auto, the speculative methods' max_step_time_ratio: draft only as much as keeps "
                   "a step's predicted time within RATIO plain steps (default: none)")
    g.add_argument("--rounds", type=int, default=1,
                   help="run every method this many times, interleaved (every other round in reverse order); "
                   "ratios to plain decoding are taken within a round, then their median (default 1)")
    g.add_argument("--max-model-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="chunked prefill in the benchmarked engine (default on)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the step's token budget with chunked prefill (default: the engine's)")
    g.add_argument("--prefill-share", type=float, default=None, metavar="SHARE",
                   help="the benchmarked engine's prefill_share (as specdec serve's; default the engine's)")
    g.add_argument("--goodput-ttft-ms", type=number(float, 0), default=1000.0,
                   help="goodput counts requests with TTFT at most this (default 1000)")
    g.add_argument("--goodput-itl-ms", type=number(float, 0), default=50.0,
                   help="... and mean ITL at most this (default 50)")
    g.add_argument("--flood-prompt-tokens", type=int, default=448, help="tokens of each flood prompt (default 448)")
    g.add_argument("--flood-stream-tokens", type=int, default=96,
                   help="tokens each measured stream generates in the flood workload (default 96)")
    g.add_argument("--flood-streams", type=int, default=1,
                   help="streams each of the flood workload's c clients runs, one after the other, so that its p99 "
                   "is taken over this many times more gaps (default 1)")
    add_shape_flags(g, "the embedded pair as it ships")
    p.set_defaults(func=run_bench_serve)


def run_bench_serve(args: argparse.Namespace) -> int:
    from specdec.train.corpus import code_prompts

    if args.json is not None:  # before the run, not after it
        check_output_file(args.json, "--json")
    if args.in_process:
        from specdec.bench.serving import run_in_process

        given = [f"--{name.replace('_', '-')}" for name in ("num_prompts", "warmup", "disconnect_fraction")
                 if getattr(args, name) is not None]
        if given:
            raise SpecDecError(f"{', '.join(given)} set a run against a server; --in-process sends its own workloads "
                               "after its own warm-up, and no client disconnects there")
        return run_in_process(args)
    if args.shape is not None or args.shape_cache is not None:
        raise SpecDecError("--shape and --shape-cache pick the in-process benchmark's models; they take --in-process "
                           "(a server runs the model it was started with)")
    if args.prefill_share is not None:
        raise SpecDecError("--prefill-share sets the in-process benchmark's engine; it takes --in-process (a server "
                           "takes it at start: specdec serve --prefill-share)")
    if args.rounds != 1:
        raise SpecDecError("--rounds interleaves the in-process benchmark's methods; it takes --in-process "
                           "(a server runs one method)")

    if any(c < 1 for c in args.concurrency):
        raise SpecDecError(f"--concurrency levels must be >= 1, got {args.concurrency}")
    check_rates(args.request_rate)
    warmup = 2 if args.warmup is None else args.warmup
    disconnect_fraction = args.disconnect_fraction or 0.0
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    levels = ([(None, rate) for rate in args.request_rate] if args.request_rate
              else [(concurrency, None) for concurrency in args.concurrency])
    sizes = [args.num_requests or max(8, 2 * (concurrency or max(args.concurrency))) for concurrency, _ in levels]
    # The warm-up and every level take the prompts after the last one sent, so that no prompt is sent twice while
    # there are prompts enough.
    prompts = code_prompts(args.num_prompts or warmup + sum(sizes), seed=args.seed)
    if len(prompts) < warmup + sum(sizes):
        print(f"bench-serve: {warmup + sum(sizes)} requests over {len(prompts)} prompts: prompts are sent again, and "
              "a server that caches across requests (suffix) is measured on outputs it has seen", file=sys.stderr)
    rng = random.Random(args.seed)
    try:
        scrape(args.base_url, headers)
    except Exception as exc:
        raise SpecDecError(f"no server answers at {args.base_url}: {exc}") from None
    if warmup:
        asyncio.run(run_level(args.base_url, args.model, prompts, 1, warmup, args.max_tokens,
                              args.temperature, headers, 0.0, rng))
    rows, sent = [], warmup
    for (concurrency, rate), num in zip(levels, sizes):
        before = settle(args.base_url, headers)
        arrivals = poisson_arrivals(num, rate, args.seed) if rate is not None else None
        results, seconds = asyncio.run(run_level(args.base_url, args.model, prompts, concurrency or 0, num,
                                                 args.max_tokens, args.temperature, headers,
                                                 disconnect_fraction, rng, arrivals, first=sent))
        sent += num
        after = settle(args.base_url, headers)
        row = summarize(results, seconds, concurrency, rate)
        row.update(running_after=after.get("running"), waiting_after=after.get("waiting"),
                   rss_mib_before=before.get("rss_bytes", 0) / 2**20, rss_mib_after=after.get("rss_bytes", 0) / 2**20)
        rows.append(row)
        print(f"{level(row):<5} {row['completed']}/{row['requests']} ok, {row['disconnected']} disconnected, "
              f"{row['errors']} errors | {row['tokens_per_second']:.1f} tok/s | TTFT ms p50 {row['ttft_ms_p50']:.0f} "
              f"p99 {row['ttft_ms_p99']:.0f} | ITL ms mean {row['itl_ms_mean']:.1f} p50 {row['itl_ms_p50']:.1f} "
              f"p99 {row['itl_ms_p99']:.1f} | running after {row['running_after']:.0f} | RSS MiB "
              f"{row['rss_mib_before']:.0f} -> {row['rss_mib_after']:.0f}", flush=True)
        for error in row["first_errors"]:
            print(f"  error: {error}", file=sys.stderr)
    if args.json is not None:
        args.json.write_text(json.dumps({"args": recorded_flags(args),
                                         "levels": rows}, indent=1))
    failure = run_failure(rows, args.base_url)
    if failure is not None:
        print(f"specdec bench-serve: error: {failure}", file=sys.stderr)
        return 1
    return 0


def run_failure(rows: list[dict[str, Any]], base_url: str) -> str | None:
    """Why a run measured nothing, in one line: no request of any level completed and some failed (every one a
    disconnect on purpose, ``--disconnect-fraction 1``, is no failure); None when some request completed."""
    failed = sum(row["errors"] for row in rows)
    if failed == 0 or any(row["completed"] for row in rows):
        return None
    total = sum(row["requests"] for row in rows)
    first = " ".join(next(e for row in rows for e in row["first_errors"]).split())
    hint = ""
    if first.startswith("HTTP 404") and not base_url.rstrip("/").endswith("/v1"):
        hint = f" (--base-url {base_url} does not end in /v1)"
    which = f"all {total} requests failed" if failed == total else \
        f"no request completed: {failed} of {total} failed, the others disconnected"
    return f"{which}; the first: {first[:300]}{hint}"

