"""``specdec serve`` as a real process on loopback, serving the embedded pair on CPU: a huge request
stalls no running stream (its inter-chunk gaps measured while multi-megabyte text, token-id and
chat prompts and 100,000 stop strings are sent), and a shutdown past ``--graceful-timeout`` ends
every request in flight in OpenAI's shape."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_process import ServeProcess

from specdec.assets import default_pair

STALL_BOUND = 0.2
"""The most a huge request may add to a running stream's longest gap, in seconds."""

pytestmark = pytest.mark.skipif(default_pair() is None, reason="the embedded default pair is not installed")

MIB = 1024 * 1024
ATTEMPTS = 3


def huge_bodies() -> dict[str, bytes]:
    """Bodies just under the 4 MiB request limit that the server must refuse without blocking."""
    text = "a few words, of text " * (int(3.9 * MIB) // 21)
    return {
        "text prompt": json.dumps({"prompt": text, "max_tokens": 2}).encode(),
        "token ids": json.dumps({"prompt": [7] * (int(3.9 * MIB) // 3), "max_tokens": 2}).encode(),
        "chat message": json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 2}).encode(),
        "stop strings": json.dumps({"prompt": "x", "stop": [f"s{i}" for i in range(100_000)]}).encode(),
    }


def test_a_huge_request_does_not_stall_a_running_stream():
    server = ServeProcess("--max-num-seqs", "4")
    try:
        arrivals: list[float] = []
        failure: list[BaseException] = []
        measured = threading.Event()

        def stream() -> None:
            # Streams one after another until every request is measured: on a loaded machine the attempts can
            # outlast one stream of the context's length.
            try:
                body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": True,
                        "temperature": 0}
                while not measured.is_set():
                    with httpx.stream("POST", server.root + "/v1/completions", json=body, timeout=120) as response:
                        assert response.status_code == 200
                        for line in response.iter_lines():
                            if line.startswith("data: "):
                                arrivals.append(time.perf_counter())
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                failure.append(exc)

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        while len(arrivals) < 25:  # a baseline of the stream's own gaps first
            assert time.monotonic() < deadline and reader.is_alive(), f"the stream did not run: {failure}"
            time.sleep(0.01)
        time.sleep(0.5)
        before = [b - a for a, b in zip(arrivals[5:], arrivals[6:])]  # past the first steps' warm-up
        baseline = sorted(before)[int(0.9 * (len(before) - 1))]
        bound = baseline + STALL_BOUND
        report, health = {}, []
        with httpx.Client(timeout=60) as client:
            for name, body in huge_bodies().items():
                route = "chat/completions" if name == "chat message" else "completions"
                longest = []
                for _ in range(ATTEMPTS):  # a stall repeats; the load of a shared machine does not
                    start = time.perf_counter()
                    response = client.post(f"{server.root}/v1/{route}", content=body,
                                           headers={"content-type": "application/json"})
                    end = time.perf_counter()
                    assert response.status_code == 400, (name, response.text[:300])
                    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
                    health_start = time.perf_counter()
                    assert client.get(server.root + "/health").status_code == 200
                    health.append(time.perf_counter() - health_start)
                    while arrivals[-1] <= end:  # the gap spanning the request has ended
                        assert reader.is_alive(), "the stream ended before every request was measured"
                        time.sleep(0.005)
                    times = list(arrivals)
                    longest.append(max(b - a for a, b in zip(times, times[1:]) if a < end and b > start))
                    if longest[-1] <= bound:
                        break
                report[name] = longest
        print(f"stream gaps before: {len(before)}, median {sorted(before)[len(before) // 2]:.3f} s, p90 "
              f"{baseline:.3f} s, longest {max(before):.3f} s; longest gap spanning each request (per attempt): "
              + "; ".join(f"{n} {', '.join(f'{g:.3f}' for g in gs)} s" for n, gs in report.items())
              + f"; /health at most {max(health):.3f} s")
        measured.set()
        for name, longest in report.items():
            assert min(longest) <= bound, (name, longest, baseline)
        assert min(health) <= STALL_BOUND
        reader.join(120)
        assert not failure, failure
    finally:
        status, log = server.stop()
    assert "Traceback" not in log, log[-3000:]


def test_shutdown_past_the_graceful_timeout_answers_every_request():
    """SIGTERM with 6 long requests in flight (2 running, 4 queued; half streaming) and a 1 s grace:
    each stream ends with an error event and ``[DONE]``, each other request gets a 503 JSON error, the
    process exits with status 0 and logs no traceback. A stream is sent first, and the others once it runs:
    sent together, two requests that do not stream could take both slots, and the first stream would start
    only as one of them ended (on a loaded machine the threads' requests arrive in any order)."""
    server = ServeProcess("--max-num-seqs", "2", "--graceful-timeout", "1")
    started = threading.Event()

    def request(stream: bool) -> tuple[int, list[str] | dict]:
        body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": stream}
        with httpx.stream("POST", server.root + "/v1/completions", json=body, timeout=60) as response:
            if not stream:
                return response.status_code, json.loads(response.read())
            lines = []
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    started.set()
            return response.status_code, lines

    def load() -> tuple[float, float]:
        """The server's running and waiting requests, from its metrics."""
        text = httpx.get(server.root + "/metrics", timeout=10).text
        return tuple(float(re.search(rf"^vllm:num_requests_{name}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))
                     for name in ("running", "waiting"))

    try:
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(request, True)]
            assert started.wait(60), "no stream started"
            futures += [pool.submit(request, i % 2 == 0) for i in range(1, 6)]
            deadline = time.monotonic() + 30
            while load() != (2, 4):  # every request in flight: one beside the stream, four queued
                done = [f.exception() or f.result() for f in futures if f.done()]
                assert not done and time.monotonic() < deadline, (load(), done)
                time.sleep(0.05)
            done = [f.exception() or f.result() for f in futures if f.done()]
            assert not done, f"requests finished before the shutdown: {done}"
            begin = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            results = [f.result(timeout=60) for f in futures]
            ended = time.monotonic() - begin
    finally:
        status, log = server.stop()
    for i, (code, got) in enumerate(results):
        assert code == (200 if i % 2 == 0 else 503), (code, got)
        if i % 2 == 0:
            assert got[-1] == "data: [DONE]", got[-3:]
            error = json.loads(got[-2].removeprefix("data: "))["error"]
        else:
            error = got["error"]
        assert set(error) == {"message", "type", "param", "code"} and "shutting down" in error["message"]
    assert status == 0 and ended < 30, (status, ended)
    assert "Traceback" not in log and "Cancel" not in log, log[-3000:]
