"""The serving benchmark (``specdec bench-serve``): the in-process closed-loop driver on a tiny model
(every request served whole, TTFT and ITL counted per token), the open loop (Poisson arrivals, the same for
every method; requests sent on time whatever runs), the multi-turn chat client (each turn carries the shared
prefix and the conversation so far), the flood that stops with the streams it floods, the comparison against
plain decoding, a tiny end-to-end run on the embedded pair, and the load generator against a server."""

import json
import math
import statistics
import time

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.bench import serving
from specdec.bench.arrivals import poisson_arrivals
from specdec.bench.serving import (
    ChatClient,
    Client,
    compare,
    drive,
    drive_open,
    flood_streams,
    summarize,
    table,
    warm_up,
)
from specdec.cli import main
from specdec.errors import SpecDecError


@pytest.fixture(scope="module")
def tiny(model_dirs):
    dirs = model_dirs["llama"]
    spec = {"method": "draft_model", "model": str(dirs["truncated"]), "num_speculative_tokens": 3}
    return LLM(dirs["target"], speculative_config=spec, dtype="float64", max_num_seqs=4, max_num_batched_tokens=8)


def test_drive_serves_every_request_and_counts_latencies(tiny):
    prompts = [[(3 * i + j) % 90 + 1 for j in range(5 + 7 * i)] for i in range(6)]
    queue = list(prompts)
    traces, seconds = drive(tiny, [Client(queue) for _ in range(3)], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(traces) == 6 and not queue and seconds > 0
    for t in traces:
        assert t.tokens == 6 == len(t.output) and t.ttft is not None and t.ttft > 0
        assert 0 <= len(t.itl) <= 5 and all(x >= 0 for x in t.itl)  # the first output's tokens are in the TTFT
    row = summarize(traces, seconds, ttft_slo_ms=1e9, itl_slo_ms=1e9)
    assert row["tokens"] == 36 and row["goodput_requests_per_second"] == pytest.approx(row["requests_per_second"])
    assert summarize(traces, seconds, ttft_slo_ms=0.0, itl_slo_ms=1e9)["goodput_requests_per_second"] == 0.0
    assert not tiny.scheduler.has_work


def test_poisson_arrivals_are_seeded_and_exponentially_spaced_at_the_rate():
    times = poisson_arrivals(4000, 2.0, seed=3)
    assert times == poisson_arrivals(4000, 2.0, seed=3) != poisson_arrivals(4000, 2.0, seed=4)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.fmean(gaps) == pytest.approx(0.5, rel=0.05)  # the mean gap is 1 / rate (3 sigma: 4%)
    # exponential, not evenly spaced: half the gaps are under ln 2 / rate, and their spread equals their mean
    assert sum(g < math.log(2) / 2.0 for g in gaps) / len(gaps) == pytest.approx(0.5, abs=0.03)
    assert statistics.stdev(gaps) == pytest.approx(0.5, rel=0.1)


@pytest.mark.parametrize("rate", [0.0, -1.0, float("nan"), float("inf")])
def test_poisson_arrivals_refuse_a_rate_that_is_not_a_positive_number(rate):
    with pytest.raises(SpecDecError, match="--request-rate levels must be finite numbers"):
        poisson_arrivals(3, rate, seed=0)


def test_drive_open_sends_each_request_at_its_arrival_whatever_runs(tiny):
    """Requests are submitted at their arrival times (idling until the next when nothing runs), their TTFT
    counts from the arrival, and every one is served whole."""
    prompts = [[(5 * i + j) % 90 + 1 for j in range(4 + 3 * i)] for i in range(5)]
    arrivals = [0.0, 0.0, 0.01, 0.4, 0.45]
    submitted = []
    submit = tiny.submit

    def timed_submit(*args, **kwargs):
        submitted.append(time.perf_counter())
        return submit(*args, **kwargs)

    tiny.submit = timed_submit
    try:
        tic = time.perf_counter()
        traces, seconds = drive_open(tiny, prompts, arrivals, SamplingParams(max_tokens=5, ignore_eos=True))
    finally:
        del tiny.submit
    assert len(traces) == 5 and seconds >= 0.45 and not tiny.scheduler.has_work
    for trace, arrival, sent in zip(traces, arrivals, submitted):
        assert trace.submitted == pytest.approx(tic + arrival, abs=0.005)
        assert sent >= trace.submitted  # never early; late only by the step it arrived in
        assert trace.tokens == 5 == len(trace.output) and trace.ttft >= sent - trace.submitted


def test_the_warm_up_fits_the_prefill_pacer(model_dirs):
    """bench-serve's warm-up feeds prompts beside a running stream, so the pacer has a line (a price per prompt
    token) before the first level; requests one at a time, the warm-up before, never gave it one."""
    prompts = [[(7 * i + j) % 90 + 1 for j in range(20 + i)] for i in range(10)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    lines = []
    for warm in (lambda llm: drive(llm, [Client(prompts[:4])], params), lambda llm: warm_up(llm, prompts, params)):
        llm = LLM(model_dirs["llama"]["target"], dtype="float64", max_num_seqs=4, serving=True)
        assert llm.scheduler.pacer is not None and llm.scheduler.pacer.line() is None
        warm(llm)
        lines.append(llm.scheduler.pacer.line())
        assert not llm.scheduler.has_work
    assert lines[0] is None and lines[1] is not None


def test_chat_client_carries_the_prefix_and_the_conversation():
    client = ChatClient([1, 1], [[2], [3], [4], [5]], conversations=[0])
    assert client.next_prompt(None) == [1, 1, 2]
    assert client.next_prompt([9, 9]) == [1, 1, 2, 9, 9, 3]
    assert client.next_prompt([8]) == [1, 1, 2, 9, 9, 3, 8, 4]
    assert client.next_prompt([7]) is None  # three turns, no conversation left


def test_chat_clients_sharing_a_queue_never_run_out_halfway():
    """A conversation takes its three questions when it starts: a second client finding fewer left sends
    nothing, and the first finishes its three turns (taking one question per turn, the second client's start
    took the first's later questions and the third turn failed with an IndexError)."""
    questions = [[2], [3], [4], [5]]
    first, second = (ChatClient([1], questions, conversations=[0, 1]) for _ in range(2))
    assert first.next_prompt(None) == [1, 2]
    assert second.next_prompt(None) is None  # one question left, a conversation needs three
    assert first.next_prompt([9]) == [1, 2, 9, 3]
    assert first.next_prompt([8]) == [1, 2, 9, 3, 8, 4]
    assert first.next_prompt([7]) is None and questions == [[5]]


def test_bench_serve_chat_fills_more_conversations_than_questions(tmp_path, capsys):
    """The chat workload cycles its questions (as the code workload cycles its prompts): 24 conversations of three
    turns at 4 streams ask 72 questions of the 64 there are (four per stream, at least 64), and are served whole;
    taking a question a turn from the 64, they failed with an IndexError."""
    out = tmp_path / "chat.json"
    assert main(["bench-serve", "--in-process", "--methods", "plain", "--workloads", "chat", "--concurrency", "4",
                 "--num-requests", "72", "--max-tokens", "2", "--json", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["workload"] == "chat" and row["requests"] == 72


def test_flood_stops_with_the_measured_streams(tiny):
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    streams = [Client([[5, 6, 7]]), Client([[8, 9]])]
    flood = Client([[(i % 80) + 1 for i in range(40)] for _ in range(50)], SamplingParams(max_tokens=1))
    traces, _ = drive(tiny, streams + [flood], params, measured=streams)
    assert len(traces) == 2 and all(t.tokens == 4 for t in traces)
    assert 0 < 50 - len(flood.prompts) < 50  # it flooded, and stopped once the streams were done


def test_flood_clients_run_their_streams_in_turn(tiny):
    """Each measured client of the flood workload runs ``streams`` prompts one after the other (client ``i``:
    prompts ``i``, ``i + clients``, ...), so its p99 is taken over that many streams' gaps."""
    prompts = [[p + 1] * 3 for p in range(5)]
    clients = flood_streams(prompts, 2, 3)
    assert [c.prompts for c in clients] == [[prompts[0], prompts[2], prompts[4]], [prompts[1], prompts[3], prompts[0]]]
    traces, _ = drive(tiny, clients, SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(traces) == 6 and all(t.tokens == 4 and len(t.itl) <= 3 for t in traces) and not any(
        c.prompts for c in clients)


def test_compare_checks_the_targets():
    def row(method, c, tps, p99, mean):
        return {"method": method, "workload": "code", "concurrency": c, "tokens_per_second": tps,
                "itl_ms_p99": p99, "itl_ms_mean": mean}

    rows = [row("plain", 1, 100, 10, 10), row("suffix", 1, 180, 10.5, 5), row("eagle", 1, 150, 9, 7),
            row("plain", 16, 800, 20, 20), row("suffix", 16, 790, 20, 20)]
    got = {(c["method"], c["concurrency"]): c for c in compare(rows)}
    assert got[("suffix", 1)]["targets_met"] and got[("suffix", 1)]["itl_mean_speedup"] == 2.0
    assert not got[("eagle", 1)]["targets_met"]  # mean ITL only 1.43x lower at one stream
    assert not got[("suffix", 16)]["targets_met"]  # throughput below plain's
    assert "| suffix | code | 1 | 1.80 | 1.05 | 2.00 | met |" in table(compare(rows))


def test_compare_takes_ratios_within_a_round_and_their_median():
    """Over rounds, each ratio is to the same round's plain decoding, then the median; the targets are judged
    on the medians. Pairing across rounds would give 2.0 (fast eagle round over slow plain round) or 0.5."""
    def row(method, r, tps, p99, mean):
        return {"method": method, "workload": "code", "concurrency": 4, "round": r, "tokens_per_second": tps,
                "itl_ms_p99": p99, "itl_ms_mean": mean}

    rows = [row("plain", 1, 100, 10, 10), row("eagle", 1, 110, 10, 8),   # machine slow: 1.10, 1.00, 1.25
            row("eagle", 2, 240, 22, 4), row("plain", 2, 200, 20, 5),    # fast: 1.20, 1.10, 1.25
            row("plain", 3, 150, 15, 8), row("eagle", 3, 135, 18, 8)]    # 0.90, 1.20, 1.00
    [got] = compare(rows)
    assert got["rounds"] == 3
    assert got["throughput_vs_plain"] == pytest.approx(1.10) and got["itl_p99_vs_plain"] == pytest.approx(1.10)
    assert got["itl_mean_speedup"] == pytest.approx(1.25)
    assert got["range"]["throughput_vs_plain"] == pytest.approx([0.90, 1.20])
    assert got["targets_met"]  # median throughput 1.10 >= 1, median p99 1.10 <= 1.1 (not one stream)
    assert "| eagle | code | 4 | 1.10 (0.90-1.20) | 1.10 (1.00-1.20) | 1.25 (1.00-1.25) | met |" in table([got])
    [one] = compare([r for r in rows if r["round"] == 3])
    assert not one["targets_met"] and "range" not in one and one["rounds"] == 1


def test_bench_serve_in_process_end_to_end(tmp_path, capsys):
    out = tmp_path / "serve.json"
    code = main(["bench-serve", "--in-process", "--methods", "plain,suffix", "--workloads", "code,chat,flood",
                 "--concurrency", "1", "2", "--max-tokens", "4", "--num-requests", "3", "--flood-prompt-tokens", "64",
                 "--flood-stream-tokens", "6", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    keys = {(r["method"], r["workload"], r["concurrency"]) for r in data["rows"]}
    assert keys == {(m, w, c) for m in ("plain", "suffix") for w in ("code", "chat", "flood-baseline", "flood")
                    for c in (1, 2)}
    for r in data["rows"]:
        assert r["tokens"] > 0 and r["ttft_ms_p50"] > 0 and "k_choices_by_batch_size" in r["policy"]
    # every level starts from an empty prefix cache: the second level's code prompts (the first level's) are fed
    # whole, and a chat's later turns find the shared prefix and their history
    hit_rates = {(r["method"], r["workload"], r["concurrency"]): r["prefix_cache_hit_rate"] for r in data["rows"]}
    assert all(hit_rates[(m, "code", c)] == 0.0 and hit_rates[(m, "chat", c)] > 0.3 for m in ("plain", "suffix")
               for c in (1, 2))
    assert {(c["workload"], c["concurrency"]) for c in data["comparison"]} == {
        (w, c) for w in ("code", "chat") for c in (1, 2)}
    assert "| method | workload |" in capsys.readouterr().out


def test_bench_serve_in_process_open_loop(tmp_path, capsys):
    """--request-rate: the code workload's levels are request rates (rows keyed by the rate, compared with
    plain decoding at the same rate); the chat workload stays a closed loop at the concurrency levels."""
    out = tmp_path / "serve.json"
    assert main(["bench-serve", "--in-process", "--methods", "plain,suffix", "--workloads", "code,chat",
                 "--concurrency", "2", "--request-rate", "40", "80", "--max-tokens", "3", "--num-requests", "3",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {(r["method"], r["workload"], r["concurrency"], r["request_rate"]) for r in data["rows"]} == {
        (m, w, c, rate) for m in ("plain", "suffix") for w, c, rate in (("code", None, 40.0), ("code", None, 80.0),
                                                                        ("chat", 2, None))}
    assert all(r["requests"] == 3 and r["tokens"] == 9 for r in data["rows"] if r["workload"] == "code")
    assert {(c["workload"], c["concurrency"], c["request_rate"]) for c in data["comparison"]} == {
        ("code", None, 40.0), ("code", None, 80.0), ("chat", 2, None)}
    captured = capsys.readouterr()
    assert "| suffix | code | 40 req/s |" in captured.out and "| suffix | chat | 2 |" in captured.out
    assert all((c["targets_met"] is None) == (c["request_rate"] is not None) for c in data["comparison"])
    assert captured.out.count("| n/a |") == 2
    assert "suffix      code           80/s" in captured.err


@pytest.mark.parametrize("argv", [["--in-process", "--methods", "plain"], []])
def test_bench_serve_bad_request_rate(argv, capsys):
    assert main(["bench-serve", *argv, "--request-rate", "2", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--request-rate levels must be finite numbers of requests per second above 0, got 0.0" \
        in err[0]


@pytest.mark.parametrize("flag", [["--warmup", "0"], ["--num-prompts", "4"], ["--disconnect-fraction", "0.5"]])
def test_bench_serve_in_process_refuses_the_flags_of_a_server_run(flag, capsys):
    """--warmup, --num-prompts and --disconnect-fraction shape a run against a server; --in-process ignored them."""
    assert main(["bench-serve", "--in-process", "--methods", "plain", *flag]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{flag[0]} set a run against a server" in err[0]


def test_bench_serve_drives_a_server_in_a_closed_and_an_open_loop(text_model_dirs, tmp_path, capsys, monkeypatch):
    """The load generator against a running server: every request of a level completes, at a concurrency
    and at a request rate, and the pool is empty after (prompts short enough for the tiny model's context). The
    warm-up and the levels send each prompt once (a server that caches across requests, as suffix does, had seen
    every measured prompt's output), unless --num-prompts holds fewer, which it says."""
    from test_server import PLAIN, TEMPLATE, Served, make_llm

    import specdec.train.corpus
    from specdec.server import create_app, loadgen

    monkeypatch.setattr(specdec.train.corpus, "code_prompts", lambda n, seed: [f"x = {i}\n" for i in range(n)])
    sent = []
    run_level = loadgen.run_level

    async def recorded(base_url, model, prompts, concurrency, num, *args, first=0, **kwargs):
        sent.extend(prompts[(first + i) % len(prompts)] for i in range(num))
        return await run_level(base_url, model, prompts, concurrency, num, *args, first=first, **kwargs)

    monkeypatch.setattr(loadgen, "run_level", recorded)

    served = Served(create_app(make_llm(text_model_dirs, None, PLAIN), served_model_name="tiny", api_key="",
                               chat_template=TEMPLATE))
    try:
        out = tmp_path / "levels.json"
        for level in (["--concurrency", "2"], ["--request-rate", "20"]):
            assert main(["bench-serve", "--base-url", served.root + "/v1", *level, "--num-requests", "4",
                         "--max-tokens", "3", "--warmup", "1", "--num-prompts", "4", "--json", str(out)]) == 0
            [row] = json.loads(out.read_text())["levels"]
            assert row["completed"] == 4 == row["requests"] and row["errors"] == 0 and row["tokens"] == 12
            assert row["running_after"] == 0 and row["ttft_ms_p50"] > 0
        assert row["request_rate"] == 20.0 and row["concurrency"] is None
        got = capsys.readouterr()
        assert "20/s  4/4 ok" in got.out and "5 requests over 4 prompts: prompts are sent again" in got.err
        sent.clear()
        assert main(["bench-serve", "--base-url", served.root + "/v1", "--concurrency", "1", "2", "--num-requests",
                     "3", "--max-tokens", "2", "--warmup", "2"]) == 0
        assert len(sent) == 8 == len(set(sent)) and "sent again" not in capsys.readouterr().err
    finally:
        served.stop()


def test_bench_serve_bad_methods(capsys):
    assert main(["bench-serve", "--in-process", "--methods", "plain,nope"]) == 2
    assert "--methods takes a comma-separated list" in capsys.readouterr().err


def test_bench_serve_rounds_interleave_the_methods(tmp_path, capsys):
    """--rounds 2: every method twice, the second round in reverse order, and the comparison over both."""
    out = tmp_path / "serve.json"
    assert main(["bench-serve", "--in-process", "--methods", "plain,suffix", "--workloads", "code", "--concurrency",
                 "2", "--max-tokens", "3", "--num-requests", "2", "--rounds", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [(r["round"], r["method"]) for r in data["rows"]] == [(1, "plain"), (1, "suffix"), (2, "suffix"),
                                                                 (2, "plain")]
    [comparison] = data["comparison"]
    assert comparison["rounds"] == 2 and set(comparison["range"]) == {
        "throughput_vs_plain", "itl_p99_vs_plain", "itl_mean_speedup"}
    assert "round 2/2 suffix" in capsys.readouterr().err
    host = data["environment"]  # where it ran, as `specdec bench` records it
    assert host["device"] == "cpu" and host["dtype"] in ("float32", "bfloat16") and host["cpus"] >= 1
    assert isinstance(host["cpu features"], str) and host["torch"]


@pytest.mark.parametrize("argv, message", [
    (["--in-process", "--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--in-process", "--flood-streams", "0"], "--flood-streams must be >= 1, got 0"),
    (["--in-process", "--flood-stream-tokens", "-2"], "--flood-stream-tokens must be >= 1, got -2"),
    (["--rounds", "3"], "--rounds interleaves the in-process benchmark's methods; it takes --in-process"),
])
def test_bench_serve_bad_rounds(argv, message, capsys):
    assert main(["bench-serve", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


@pytest.mark.parametrize("argv, message", [
    (["--max-step-time-ratio", "0.5"], "max_step_time_ratio must be a finite number >= 1"),
    (["--k", "3", "--max-step-time-ratio", "1.1"], "set num_speculative_tokens to 'auto'"),
])
def test_bench_serve_checks_the_speculative_config_before_running_plain_decoding(argv, message, capsys):
    """A bad speculative setting fails at once (exit 2, one line), not after plain decoding's run."""
    assert main(["bench-serve", "--in-process", "--methods", "plain,eagle", "--workloads", "code", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_bench_serve_in_process_at_a_shape(tmp_path, capsys):
    """--shape runs the serving benchmark on the embedded pair inflated to that shape, and says so."""
    out = tmp_path / "serve.json"
    code = main(["bench-serve", "--in-process", "--shape", "tiny", "--shape-cache", str(tmp_path / "cache"),
                 "--methods", "plain,draft_model", "--workloads", "code", "--concurrency", "1", "--max-tokens", "4",
                 "--num-requests", "2", "--max-step-time-ratio", "1.2", "--json", str(out)])
    assert code == 0
    assert "shape tiny, the embedded pair inflated" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["settings"]["shape"] == "tiny" and data["settings"]["max_step_time_ratio"] == 1.2
    assert {(r["method"], r["workload"]) for r in data["rows"]} == {("plain", "code"), ("draft_model", "code")}
    assert all(r["tokens"] > 0 for r in data["rows"])


@pytest.mark.parametrize("argv, message", [
    (["--shape", "tiny"], "take --in-process"),
    (["--in-process", "--shape-cache", "x", "--methods", "plain", "--workloads", "code", "--concurrency", "1"],
     "--shape-cache needs --shape"),
])
def test_bench_serve_shape_flags_need_their_partners(argv, message, capsys):
    assert main(["bench-serve", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_bench_serve_prefill_share_reaches_the_engine(monkeypatch):
    shares, warm = [], serving.warm_up
    monkeypatch.setattr(serving, "warm_up", lambda llm, *a: (shares.append(llm.scheduler.pacer.share), warm(llm, *a)))
    assert main(["bench-serve", "--in-process", "--methods", "plain", "--workloads", "code", "--concurrency", "1",
                 "--max-tokens", "2", "--num-requests", "2", "--prefill-share", "0.75"]) == 0
    assert shares == [0.75]


@pytest.mark.parametrize("argv, message", [
    (["--in-process", "--prefill-share", "0"], "prefill_share must be a number > 0 "),
    (["--in-process", "--prefill-share", "1", "--max-num-batched-tokens", "256"], "prefill_share paces chunked"),
    (["--prefill-share", "1"], "--prefill-share sets the in-process benchmark's engine; it takes --in-process"),
])
def test_bench_serve_bad_prefill_share(argv, message, capsys):
    assert main(["bench-serve", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_interleaved_control_runs_the_first_variant_under_every_name(monkeypatch, capsys, tmp_path):
    """``--control`` (an A/A) installs the first variant for both names; without it each name installs its own.
    The report's ratios are each round's first variant over its second, then the median. ``--json`` writes the
    rows with the settings and where they ran."""
    from specdec.bench import interleaved

    def run_rounds(variants, methods, args, rounds, target, draft):
        for install in variants.values():
            install()
        rows = []
        for r in range(1, rounds + 1):
            for name, tps in (("new", 120.0 * r), ("old", 100.0 * r)):
                for method in methods:
                    rows.append({"method": method, "workload": "code", "concurrency": 4, "round": r,
                                 "variant": name, "tokens_per_second": tps if method == "eagle" else 100.0 * r,
                                 "ttft_ms_p50": 10.0, "itl_ms_p99": 20.0 if name == "new" else 25.0,
                                 "itl_ms_mean": 5.0})
        return rows

    monkeypatch.setattr(interleaved, "run_rounds", run_rounds)
    for control, expected in ((False, ["a", "b"]), (True, ["a", "a"])):
        calls = []
        variants = {"new": lambda calls=calls: calls.append("a"), "old": lambda calls=calls: calls.append("b")}
        out = tmp_path / f"rows-{control}.json"
        cli, rest = interleaved.arguments("test", rounds=2).parse_known_args(
            ["--methods", "plain,eagle", "--rounds", "2", "--json", str(out), *(["--control"] if control else [])])
        interleaved.main(cli, rest, variants)
        assert calls == expected
        written = json.loads(out.read_text())
        assert [(r["variant"], r["round"]) for r in written["rows"]][:2] == [("new", 1), ("new", 1)]
        assert len(written["rows"]) == 8 and written["settings"]["rounds"] == 2
        assert written["settings"]["methods"] == "plain,eagle"
        assert written["environment"]["dtype"] and written["environment"]["torch"] == torch.__version__
    assert "eagle, code, 4 streams, new / old, medians: tokens_per_second 1.20, ttft_ms_p50 1.00, itl_ms_p99 0.80" \
        in capsys.readouterr().out


def test_bench_serve_in_process_levels_start_with_a_drafter_that_forgot(monkeypatch):
    """Every level sends prompts the warm-up (and the level before) sent: suffix's cache of earlier outputs is emptied
    before each level (it drafted those outputs from memory: 224 of 224 drafts accepted at two streams)."""
    from specdec.drafters.suffix import SuffixDrafter

    forgot = []
    forget = SuffixDrafter.forget
    monkeypatch.setattr(SuffixDrafter, "forget", lambda self: forgot.append(len(self.shared.docs)) or forget(self))
    assert main(["bench-serve", "--in-process", "--methods", "suffix", "--workloads", "code", "--concurrency", "1",
                 "2", "--max-tokens", "3", "--num-requests", "2"]) == 0
    assert len(forgot) == 2 and min(forgot) > 0  # before each level, with the outputs of the requests before it


def test_a_json_record_leaves_the_api_key_out():
    import argparse
    from pathlib import Path

    from specdec.server.loadgen import recorded_flags

    flags = argparse.Namespace(api_key="sekret", model=None, levels=[1, 4], json=Path("out.json"), func=print)
    assert recorded_flags(flags) == {"api_key": "<given, not recorded>", "model": None, "levels": [1, 4],
                                     "json": "out.json"}
    assert recorded_flags(argparse.Namespace(api_key=None))["api_key"] is None
