"""``specdec bench-serve --in-process``: the serving benchmark, driving an ``LLM`` through the server's own
loop (``submit``, then ``step`` until idle, as :class:`specdec.server.worker.EngineWorker` does) with
no HTTP in between, so that what is measured is the scheduler and the engine under load.

Workloads (closed loop: ``c`` clients, each sending its next request when its last one finished):

- ``code``: single-turn completions of held-out code prompts, ``max_tokens`` each (``ignore_eos``). With
  ``--request-rate`` an open loop instead: ``--num-requests`` of them arrive at random at each rate, whatever
  is running (:mod:`specdec.bench.arrivals`), so that every method is sent the same requests at the same
  moments; a closed loop at saturation sends a faster method more requests and more prompt to prefill.
- ``chat``: multi-turn conversations sharing one system prefix; each turn's prompt is the prefix, the
  conversation so far (questions and the model's own answers) and a new question.
- ``flood``: ``c`` clients each running ``--flood-streams`` long streams one after the other, measured alone
  and then while clients keep sending long prompts (one token each): how much the prompt flood moves the
  running streams' p99 inter-token latency.

Per method and load (concurrency or request rate): throughput (generated tokens per second of wall time), TTFT
and ITL p50, p99 and mean, and goodput (requests per second whose TTFT and mean ITL both meet
``--goodput-ttft-ms`` and ``--goodput-itl-ms``), plus the speculation policy's decisions at that load (rows
given each k, steps with speculation off). With ``--rounds N`` every method runs ``N`` times, interleaved, and
each ratio to plain decoding is taken within a round, then its median over the rounds (a busy machine's speed
moves by tens of percent over minutes). ITL follows :mod:`specdec.server.loadgen`: a step that hands a request
``m`` tokens ``g`` seconds after its previous ones counts ``m`` latencies of ``g / m`` (time per output token).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.bench.arrivals import check_rates, poisson_arrivals
from specdec.errors import SpecDecError
from specdec.server.loadgen import latencies, level, percentile, recorded_flags

METHODS = ("plain", "draft_model", "eagle", "suffix")
WORKLOADS = ("code", "chat", "flood")
CHAT_TURNS = 3
FLOOD_CLIENTS = 2
"""Clients sending long prompts back to back in the flood workload."""


@dataclass
class Trace:
    """One request as the serving loop saw it (seconds from ``time.perf_counter``)."""

    submitted: float
    tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    last: float = 0.0
    output: list[int] = field(default_factory=list)


class Client:
    """Sends its requests one after the other: ``next_prompt(previous output ids)`` returns the next
    prompt's token ids, or None when it is done; ``params``: its requests' sampling parameters (None:
    the run's)."""

    def __init__(self, prompts: list[list[int]], params=None) -> None:
        self.prompts, self.params = prompts, params

    def next_prompt(self, previous: list[int] | None) -> list[int] | None:
        return self.prompts.pop(0) if self.prompts else None


class ChatClient(Client):
    """Conversations of ``CHAT_TURNS`` turns from a shared queue of questions: each turn's prompt is the
    shared ``prefix``, the history (questions and answers) and the next question. A conversation takes its
    ``CHAT_TURNS`` questions when it starts (none starts on fewer), so clients sharing the queue never run
    out of one halfway."""

    def __init__(self, prefix: list[int], questions: list[list[int]], conversations: list[int]) -> None:
        super().__init__([])
        self.prefix, self.questions, self.conversations = prefix, questions, conversations
        self.history: list[int] = []
        self.turns: list[list[int]] = []

    def next_prompt(self, previous: list[int] | None) -> list[int] | None:
        if previous is not None:
            self.history += previous
        if not self.turns:
            if not self.conversations or len(self.questions) < CHAT_TURNS:
                return None
            self.conversations.pop()
            self.turns, self.history = self.questions[:CHAT_TURNS], []
            del self.questions[:CHAT_TURNS]
        self.history += self.turns.pop(0)
        return self.prefix + self.history


def collect(handle, trace: Trace, now: float) -> bool:
    """Take a request's new outputs into its trace at time ``now``: the first output's tokens give the TTFT,
    each later output of ``m`` tokens ``m`` latencies of its gap over ``m``; True once the request finished."""
    if handle.error is not None:
        raise SpecDecError(f"a request failed in the benchmark: {handle.error}")
    finished = False
    while handle.pending:
        item = handle.pending.popleft()
        new = len(item.token_ids)
        if new:
            if trace.ttft is None:
                trace.ttft = now - trace.submitted
            else:
                trace.itl.extend([(now - trace.last) / new] * new)
            trace.last, trace.tokens = now, trace.tokens + new
            trace.output += item.token_ids
        finished = finished or item.finished
    return finished


def drive(llm, clients: list[Client], params, measured: list[Client] | None = None) -> tuple[list[Trace], float]:
    """Run the clients to completion through ``llm.submit`` and ``llm.step``; returns the traces of the
    requests of ``measured`` clients (default: all) and the wall time. A client not measured sends
    nothing more once no measured request runs (the flood stops with the streams it floods)."""
    measured = clients if measured is None else measured
    active: dict[str, tuple[Client, Any, Trace]] = {}
    traces: list[Trace] = []

    def send(client: Client, previous: list[int] | None) -> None:
        is_measured = any(client is m for m in measured)
        if not is_measured and not any(any(c is m for m in measured) for c, _, _ in active.values()):
            return
        prompt = client.next_prompt(previous)
        if prompt is None:
            return
        handle = llm.submit({"prompt_token_ids": prompt}, client.params or params)
        trace = Trace(time.perf_counter())
        active[handle.seq.request_id] = (client, handle, trace)
        if is_measured:
            traces.append(trace)

    tic = time.perf_counter()
    for client in sorted(clients, key=lambda c: not any(c is m for m in measured)):  # measured ones first
        send(client, None)
    while active:
        llm.step()
        now = time.perf_counter()
        for request_id, (client, handle, trace) in list(active.items()):
            if collect(handle, trace, now):
                del active[request_id]
                send(client, trace.output)
    return traces, time.perf_counter() - tic


def drive_open(llm, prompts: list[list[int]], arrivals: list[float], params) -> tuple[list[Trace], float]:
    """Send ``prompts[i]`` ``arrivals[i]`` seconds after the start (:func:`specdec.bench.arrivals.poisson_arrivals`),
    whatever is running, and step until all are served; returns their traces and the wall time. A request that
    arrives during a step is submitted after it, and its TTFT counts from its arrival, as a server's would
    (it waited for the step, as it would have in the server's queue)."""
    active: list[tuple[Any, Trace]] = []
    traces: list[Trace] = []
    due = 0
    tic = time.perf_counter()
    while due < len(prompts) or active:
        now = time.perf_counter()
        if not active and due < len(prompts) and tic + arrivals[due] > now:
            time.sleep(tic + arrivals[due] - now)  # idle until the next request arrives
            now = time.perf_counter()
        while due < len(prompts) and tic + arrivals[due] <= now:
            handle = llm.submit({"prompt_token_ids": prompts[due]}, params)
            trace = Trace(tic + arrivals[due])
            active.append((handle, trace))
            traces.append(trace)
            due += 1
        llm.step()
        now = time.perf_counter()
        active = [(handle, trace) for handle, trace in active if not collect(handle, trace, now)]
    return traces, time.perf_counter() - tic


def summarize(traces: list[Trace], seconds: float, ttft_slo_ms: float, itl_slo_ms: float) -> dict[str, Any]:
    """Throughput, latency percentiles (milliseconds) and goodput of one run."""
    ttft = [t.ttft * 1000 for t in traces if t.ttft is not None]
    itl = [x * 1000 for t in traces for x in t.itl]
    tokens = sum(t.tokens for t in traces)
    good = [t for t in traces if t.ttft is not None and t.ttft * 1000 <= ttft_slo_ms
            and (not t.itl or statistics.fmean(t.itl) * 1000 <= itl_slo_ms)]
    return {
        "requests": len(traces), "seconds": seconds, "tokens": tokens,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "requests_per_second": len(traces) / seconds if seconds else 0.0,
        "goodput_requests_per_second": len(good) / seconds if seconds else 0.0,
        **latencies(ttft, itl),
    }


def decisions(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The policy's choices between two snapshots of ``BatchMetrics.to_dict()``: rows given each k by batch
    size, steps with speculation off, steps, draft and accepted tokens."""
    by_size: dict[int, dict[int, int]] = {}
    for rows, ks in after["k_choices_by_batch_size"].items():
        old = before["k_choices_by_batch_size"].get(rows, {})
        diff = {k: n - old.get(k, 0) for k, n in ks.items() if n - old.get(k, 0)}
        if diff:
            by_size[rows] = dict(sorted(diff.items()))
    steps = after["num_steps"] - before["num_steps"]
    return {"steps": steps,
            "speculation_off_steps": after["num_speculation_off_steps"] - before["num_speculation_off_steps"],
            "k_choices_by_batch_size": dict(sorted(by_size.items())),
            "draft_tokens": after["num_draft_tokens"] - before["num_draft_tokens"],
            "accepted_tokens": after["num_accepted_tokens"] - before["num_accepted_tokens"]}


def speculative_config(method: str, k: int | str, draft: str, max_step_time_ratio: float | None = None
                       ) -> dict[str, Any] | None:
    """The speculative_config of a benchmarked method on the embedded pair (eagle: its shipped heads)."""
    if method == "plain":
        return None
    config: dict[str, Any] = {"method": method, "num_speculative_tokens": k}
    if max_step_time_ratio is not None:
        config["max_step_time_ratio"] = max_step_time_ratio
    if method == "draft_model":
        config["model"] = draft
    return config


def build_workloads(llm, args) -> dict[str, Any]:
    """Token-id prompts of every workload, the same for every method."""
    from specdec.train.corpus import code_prompts

    encode = llm.tokenizer
    texts = code_prompts(max(64, 4 * max(args.concurrency)), seed=args.seed)
    ids = [encode(t)["input_ids"][:96] for t in texts]
    prefix = encode("# system: you are a careful Python assistant; answer with code only.\n"
                    + texts[0] + texts[1])["input_ids"][:160]
    room = llm.max_model_len - args.max_tokens - 8
    long = []
    for i in range(len(ids)):
        joined = [t for j in range(i, i + 12) for t in ids[j % len(ids)]]
        long.append(joined[: min(args.flood_prompt_tokens, room)])
    return {"code": ids, "chat_prefix": prefix, "chat_questions": [q[:40] for q in ids], "long": long}


def flood_streams(prompts: list[list[int]], clients: int, streams: int) -> list[Client]:
    """The flood workload's ``clients`` measured clients, each running ``streams`` of ``prompts`` in turn (client
    ``i`` prompts ``i``, ``i + clients``, ...): at one stream a p99 over one stream of 96 gaps is about its largest
    gap."""
    return [Client([prompts[(i + j * clients) % len(prompts)] for j in range(streams)]) for i in range(clients)]


def warm_up(llm, prompts: list[list[int]], params) -> None:
    """Before the first level: the forwards' shapes, the speculation policy's first fits (four requests of
    ``params`` one at a time: steps without prompt tokens, the only ones its cost model learns from), then the
    prefill pacer's: two more streams, one after the other, while a second client sends other prompts back to
    back (one token each) until they end, so that the pacer has priced prompt tokens fed beside a decoding
    row (until then it gives a prompt 8 tokens a step; one request at a time never fits it). Every prompt is
    one not sent before in the warm-up: a prompt found in the prefix cache prices a prompt token near nothing."""
    from specdec import SamplingParams

    drive(llm, [Client(copy.deepcopy(prompts[:4]))], params)
    one = SamplingParams(max_tokens=1, temperature=params.temperature, ignore_eos=True)
    streams = Client(copy.deepcopy(prompts[4:6]))
    drive(llm, [streams, Client(copy.deepcopy(prompts[6:22]), one)], params, measured=[streams])


def run_method(method: str, args, workloads: dict[str, Any] | None, target: Path,
               draft: Path, round_number: int = 1) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every workload and concurrency for one method on the pair ``target``, ``draft``: its rows (JSON-ready),
    each marked with ``round_number`` (1 to ``args.rounds``)."""
    from specdec import LLM, SamplingParams

    llm = LLM(str(target), speculative_config=speculative_config(method, args.k, str(draft), args.max_step_time_ratio),
              max_num_seqs=max(args.concurrency) + FLOOD_CLIENTS, max_model_len=args.max_model_len,
              enable_chunked_prefill=args.enable_chunked_prefill, max_num_batched_tokens=args.max_num_batched_tokens,
              serving=True, prefill_share=args.prefill_share)
    workloads = workloads or build_workloads(llm, args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True, seed=None)
    warm_up(llm, workloads["code"], params)
    rows = []

    def start() -> dict[str, Any]:
        """Before a level: an empty prefix cache and a drafter that forgot earlier requests (every level sends
        prompts from the first, which the warm-up sent too; cached, a later level's prompts would cost next to
        nothing to feed, and suffix would draft their outputs from memory: at one and two streams on the embedded
        pair it ran 2.9x and 3.3x plain decoding, every draft accepted at two, against 1.1x and 0.85x on outputs
        it had not seen: ``docs/lab-notes/2026-12-01-suffix-memory.md``), and the counters the row is measured
        from."""
        llm.reset_prefix_cache()
        if llm.engine.drafter is not None:
            llm.engine.drafter.forget()
        return {**llm.batch_metrics.to_dict(), "prefix": llm.engine.cache.prefix_cache_counts()}

    def record(workload: str, concurrency: int | None, traces: list[Trace], seconds: float, before: dict,
               request_rate: float | None = None, **extra) -> None:
        queries, hits = (now - then for now, then in zip(llm.engine.cache.prefix_cache_counts(), before["prefix"]))
        row = {"method": method, "workload": workload, "concurrency": concurrency, "request_rate": request_rate,
               "round": round_number,
               **summarize(traces, seconds, args.goodput_ttft_ms, args.goodput_itl_ms),
               "prefix_cache_hit_rate": hits / queries if queries else 0.0,
               "policy": decisions(before, llm.batch_metrics.to_dict()), **extra}
        rows.append(row)
        print(line(row, args.rounds), file=sys.stderr, flush=True)

    for workload in args.workloads:
        if workload == "code" and args.request_rate:  # open loop: the levels are request rates
            num = args.num_requests or max(8, 2 * max(args.concurrency))
            queue = [workloads["code"][i % len(workloads["code"])] for i in range(num)]
            for rate in args.request_rate:
                before = start()
                traces, seconds = drive_open(llm, queue, poisson_arrivals(num, rate, args.seed), params)
                record(workload, None, traces, seconds, before, request_rate=rate)
            continue
        for c in args.concurrency:
            before = start()
            if workload == "code":
                num = args.num_requests or max(8, 2 * c)
                queue = [workloads["code"][i % len(workloads["code"])] for i in range(num)]
                clients = [Client(queue) for _ in range(c)]  # one shared queue
                traces, seconds = drive(llm, clients, params)
                record(workload, c, traces, seconds, before)
            elif workload == "chat":
                conversations = list(range(max(c, (args.num_requests or 2 * c) // CHAT_TURNS)))
                asked = workloads["chat_questions"]  # cycled, as the code prompts are, to fill every conversation
                questions = [asked[i % len(asked)] for i in range(CHAT_TURNS * len(conversations))]  # never mutated
                clients = [ChatClient(workloads["chat_prefix"], questions, conversations) for _ in range(c)]
                traces, seconds = drive(llm, clients, params)
                record(workload, c, traces, seconds, before)
            else:
                stream_params = SamplingParams(max_tokens=args.flood_stream_tokens, temperature=args.temperature,
                                               ignore_eos=True)
                alone, seconds = drive(llm, flood_streams(workloads["code"], c, args.flood_streams), stream_params)
                record("flood-baseline", c, alone, seconds, before)
                before = start()
                streams = flood_streams(workloads["code"], c, args.flood_streams)
                one = SamplingParams(max_tokens=1, temperature=args.temperature, ignore_eos=True)
                flood = [Client(copy.deepcopy(workloads["long"]), one) for _ in range(FLOOD_CLIENTS)]
                mixed, seconds = drive(llm, streams + flood, stream_params, measured=streams)
                base = percentile([x for t in alone for x in t.itl], 99)
                p99 = percentile([x for t in mixed for x in t.itl], 99)
                record("flood", c, mixed, seconds, before, itl_p99_vs_baseline=p99 / base if base else None)
    return workloads, rows


def line(row: dict[str, Any], rounds: int = 1) -> str:
    """One row as printed while the benchmark runs (its round too when there are several)."""
    policy = row["policy"]
    off = f"{policy['speculation_off_steps']}/{policy['steps']} steps off"
    extra = f" | p99 ITL x{row['itl_p99_vs_baseline']:.2f} of no flood" if row.get("itl_p99_vs_baseline") else ""
    which = f"round {row['round']}/{rounds} " if rounds > 1 else ""
    return (f"{which}{row['method']:<11} {row['workload']:<14} {level(row):<5} "
            f"{row['tokens_per_second']:7.1f} tok/s "
            f"| goodput {row['goodput_requests_per_second']:.2f} req/s | TTFT ms p50 {row['ttft_ms_p50']:.0f} "
            f"p99 {row['ttft_ms_p99']:.0f} | ITL ms mean {row['itl_ms_mean']:.1f} p50 {row['itl_ms_p50']:.1f} "
            f"p99 {row['itl_ms_p99']:.1f} | {off}{extra}")


RATIOS = ("throughput_vs_plain", "itl_p99_vs_plain", "itl_mean_speedup")


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each speculative row against plain decoding's of the same round, workload and concurrency: throughput
    ratio, p99 ITL ratio, mean ITL speedup; over several rounds the median of each ratio, with its range
    (``range``: ratio -> [lowest, highest]). Whether the issue's targets hold (throughput >= plain, p99 ITL
    <= 1.1x plain, at one stream mean ITL >= 1.6x lower) is judged on the medians; the targets are set at
    concurrencies, so at a request rate (where every method is sent the same requests and throughput follows
    the rate) ``targets_met`` is None."""
    def load(r: dict[str, Any]) -> tuple[int | None, float | None]:
        return r["concurrency"], r.get("request_rate")

    plain = {(r.get("round", 1), r["workload"], load(r)): r for r in rows if r["method"] == "plain"}
    ratios: dict[tuple[str, str, tuple[int | None, float | None]], list[tuple[float, float, float]]] = {}
    for r in rows:
        ref = plain.get((r.get("round", 1), r["workload"], load(r)))
        if r["method"] == "plain" or ref is None or r["workload"].startswith("flood"):
            continue
        ratios.setdefault((r["method"], r["workload"], load(r)), []).append((
            r["tokens_per_second"] / ref["tokens_per_second"], r["itl_ms_p99"] / ref["itl_ms_p99"],
            ref["itl_ms_mean"] / r["itl_ms_mean"]))
    out = []
    for (method, workload, (concurrency, rate)), values in ratios.items():
        median = dict(zip(RATIOS, (statistics.median(v[i] for v in values) for i in range(len(RATIOS)))))
        ok = (median["throughput_vs_plain"] >= 1.0 and median["itl_p99_vs_plain"] <= 1.1
              and (concurrency != 1 or median["itl_mean_speedup"] >= 1.6)) if rate is None else None
        entry = {"method": method, "workload": workload, "concurrency": concurrency, "request_rate": rate,
                 **median, "targets_met": ok, "rounds": len(values)}
        if len(values) > 1:
            entry["range"] = {name: [min(v[i] for v in values), max(v[i] for v in values)]
                              for i, name in enumerate(RATIOS)}
        out.append(entry)
    return out


TARGETS = {True: "met", False: "missed", None: "n/a"}


def table(comparison: list[dict[str, Any]]) -> str:
    """The comparison as a Markdown table (over several rounds: the median, then the range in parentheses)."""
    lines = ["| method | workload | load | throughput / plain | p99 ITL / plain | mean ITL speedup | targets |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for c in comparison:
        spans = c.get("range", {})
        cells = [f"{c[name]:.2f}" + (f" ({spans[name][0]:.2f}-{spans[name][1]:.2f})" if name in spans else "")
                 for name in RATIOS]
        load = f"{c['request_rate']:g} req/s" if c.get("request_rate") is not None else str(c["concurrency"])
        lines.append(f"| {c['method']} | {c['workload']} | {load} | {' | '.join(cells)} | "
                     f"{TARGETS[c['targets_met']]} |")
    return "\n".join(lines)


def pair_folders(args) -> tuple[Path, Path]:
    """The target and draft folders: the embedded pair, or with ``--shape`` the pair inflated to that shape
    (its heads inside the target folder, as ``specdec bench --shape`` runs it; the shape is printed)."""
    if args.shape is None:
        from specdec.assets import require_default_pair

        if args.shape_cache is not None:
            raise SpecDecError("--shape-cache needs --shape")
        return require_default_pair()
    from specdec.inflate.pair import cached_pair

    pair = cached_pair(args.shape, args.shape_cache)
    print(f"bench-serve: shape {pair.describe()}", flush=True)
    return pair.target, pair.draft


def run_in_process(args) -> int:
    """``specdec bench-serve --in-process``: every method in turn (one ``LLM`` at a time), ``--rounds`` times
    (every other round in reverse order), then the table."""
    from transformers.utils import logging as hf_logging

    from specdec.generate_cli import checked_config
    from specdec.models.loader import resolve_device
    from specdec.scheduler import prefill_share_of

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        raise SpecDecError(f"--methods takes a comma-separated list of {', '.join(METHODS)}, got {args.methods!r}")
    workloads_named = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = sorted(set(workloads_named) - set(WORKLOADS))
    if bad or not workloads_named:
        raise SpecDecError(f"--workloads takes a comma-separated list of {', '.join(WORKLOADS)}, "
                           f"got {args.workloads!r}")
    if any(c < 1 for c in args.concurrency):
        raise SpecDecError(f"--concurrency levels must be >= 1, got {args.concurrency}")
    check_rates(args.request_rate)
    prefill_share_of(args.prefill_share, args.enable_chunked_prefill, args.max_num_batched_tokens,
                     resolve_device("auto"), serving=True)
    args.workloads = workloads_named
    for method in methods:  # a bad --k or --max-step-time-ratio fails now, not after plain decoding's run
        checked_config(speculative_config(method, args.k, "draft", args.max_step_time_ratio))
    for name in ("rounds", "flood_prompt_tokens", "flood_stream_tokens", "flood_streams"):
        if getattr(args, name) < 1:
            raise SpecDecError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    target, draft = pair_folders(args)
    workloads, rows = None, []
    for round_number in range(1, args.rounds + 1):
        # Every other round in reverse, so that no method always runs first after a slow spell of the machine.
        for method in methods if round_number % 2 else methods[::-1]:
            workloads, method_rows = run_method(method, args, workloads, target, draft, round_number)
            rows += method_rows
            gc.collect()  # the method's LLM and its pools, before the next one is built
    comparison = compare(rows)
    print(table(comparison))
    if args.json is not None:
        Path(args.json).write_text(json.dumps({**record(args, target), "rows": rows, "comparison": comparison},
                                              indent=1))
    return 0


def record(args: argparse.Namespace, target: str) -> dict[str, Any]:
    """What a JSON record of in-process runs holds besides its rows: ``settings`` (the flags) and ``environment``
    (where it ran: :func:`specdec.bench.prepare.environment`, at the dtype ``auto`` gives ``target``)."""
    from transformers import AutoConfig

    from specdec.bench.prepare import environment
    from specdec.models.loader import resolve_device, resolve_dtype

    device = resolve_device("auto")
    return {"settings": recorded_flags(args),
            "environment": environment(device, resolve_dtype("auto", AutoConfig.from_pretrained(target), device))}
