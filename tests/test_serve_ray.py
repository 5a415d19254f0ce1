"""``specdec serve --replicas 2`` on a local Ray instance: 2 replicas of the embedded pair, 1 thread each.

Both replicas serve and the load spreads over them; streaming, auth, errors and client disconnects
work through Ray Serve's proxy; ``/metrics`` shows each replica's metrics with a ``replica`` label and
``/health`` counts the replicas; a replica killed under load leaves its in-flight requests an error in
OpenAI's shape (no hang) while every other request finishes, and new requests succeed; SIGTERM stops
everything with status 0. Marked ``ray`` (a Ray instance takes tens of seconds to start); skipped only
when ray is not installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import httpx
import pytest

from specdec.assets import default_pair

pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install -e '.[ray]')")
pytestmark = [pytest.mark.ray,
              pytest.mark.skipif(default_pair() is None, reason="the embedded default pair is not shipped")]

KEY = "ray-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
REPLICA_PROCESS = "ServeReplica:specdec:specdec"


class Replicas:
    """``specdec serve --replicas 2`` in a subprocess (its own local Ray instance) on a free port."""

    def __init__(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.root = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115
        env = {**os.environ, "SPECDEC_API_KEY": KEY, "RAY_USAGE_STATS_ENABLED": "0"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specdec.cli", "serve", "--replicas", "2", "--threads-per-replica", "1",
             "--port", str(self.port), "--graceful-timeout", "60", "--log-level", "warning"],
            stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while f"at http://127.0.0.1:{self.port}/v1" not in self.output():
            assert self.proc.poll() is None, f"the server exited: {self.output()[-3000:]}"
            assert time.monotonic() < deadline, f"the replicas did not start: {self.output()[-3000:]}"
            time.sleep(0.5)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def replica_pids(self) -> list[int]:
        """The replicas' processes (Ray workers named after the deployment), descendants of the server."""
        children: dict[int, list[int]] = defaultdict(list)
        names: dict[int, str] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                names[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue
            children[ppid].append(int(entry.name))
        found, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            todo.extend(children.get(pid, []))
            name = names.get(pid, "")
            if REPLICA_PROCESS in name and REPLICA_PROCESS + "-board" not in name:
                found.append(pid)
        return sorted(found)

    def stop(self) -> tuple[int, str]:
        """SIGTERM, wait; then SIGKILL whatever of its process group (the local Ray instance) is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=120)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        return self.proc.returncode, self.output()


@pytest.fixture(scope="module")
def replicas():
    server = Replicas()
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _metric(root: str, name: str) -> dict[str, float]:
    """``{replica: value}`` of metric ``name`` summed over its other labels."""
    text = httpx.get(root + "/metrics", timeout=30).text
    values: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            replica = dict(part.split("=", 1) for part in labels.split(","))["replica"].strip('"')
            values[replica] += float(value)
    return dict(values)


def _stream(root: str, body: dict, results: list, index: int, stop_after: int | None = None,
            seen: list[int] | None = None) -> None:
    """Stream a completion; ``results[index]`` = (status, events); closes after ``stop_after`` events;
    ``seen[index]``: the events received so far, as they arrive."""
    events: list = []
    try:
        with httpx.stream("POST", root + "/v1/completions", json={**body, "stream": True}, headers=AUTH,
                          timeout=httpx.Timeout(120, connect=10)) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    events.append(data if data == "[DONE]" else json.loads(data))
                    if seen is not None:
                        seen[index] = len(events)
                    if stop_after is not None and len(events) >= stop_after:
                        break
            results[index] = (response.status_code, events)
    except httpx.HTTPError as exc:
        results[index] = ("transport", repr(exc))


def test_both_replicas_serve_and_the_load_spreads(replicas):
    before = _metric(replicas.root, "vllm:request_success_total")
    results: list = [None] * 8
    threads = [threading.Thread(target=_stream, args=(replicas.root, {"prompt": f"def f{i}(x):", "max_tokens": 24,
                                                                      "ignore_eos": True}, results, i))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for status, events in results:
        assert status == 200 and events[-1] == "[DONE]", events
        assert events[-2]["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + 30  # the other replica's snapshot is up to one push interval old
    while True:
        after = _metric(replicas.root, "vllm:request_success_total")
        served = {r: after[r] - before.get(r, 0) for r in after}
        if sum(served.values()) == 8 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(served) == 2 and sum(served.values()) == 8, served
    assert all(count >= 1 for count in served.values()), served  # both replicas served
    health = httpx.get(replicas.root + "/health", timeout=30).json()
    assert health["status"] == "ok" and health["healthy_replicas"] == 2, health
    assert sorted(health["replicas"]) == sorted(after)


def test_routes_auth_and_errors_through_the_proxy(replicas):
    root = replicas.root
    assert httpx.get(root + "/v1/models", headers=AUTH, timeout=30).json()["data"][0]["id"] == "specdec-default-pair"
    chat = httpx.post(root + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "messages": [{"role": "user", "content": "sort a list"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
    unauthorized = httpx.post(root + "/v1/completions", json={"prompt": "x"}, timeout=30)
    assert unauthorized.status_code == 401
    assert unauthorized.json()["error"]["code"] == "invalid_api_key"
    bad = httpx.post(root + "/v1/completions", headers=AUTH, json={"prompt": "x", "max_tokens": -1}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    missing = httpx.get(root + "/v2/nothing", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"


def test_client_disconnect_through_the_proxy_aborts_the_sequence(replicas):
    before = sum(_metric(replicas.root, "specdec:request_aborted_total").values())
    results: list = [None]
    _stream(replicas.root, {"prompt": "def long(x):", "max_tokens": 400, "ignore_eos": True}, results, 0,
            stop_after=3)
    assert results[0][0] == 200
    deadline = time.monotonic() + 60
    while sum(_metric(replicas.root, "specdec:request_aborted_total").values()) < before + 1:
        assert time.monotonic() < deadline, "the disconnected client's sequence was not aborted"
        time.sleep(0.5)
    while sum(_metric(replicas.root, "vllm:num_requests_running").values()) != 0:
        assert time.monotonic() < deadline, "a sequence still runs after its client left"
        time.sleep(0.5)


def test_a_replica_killed_under_load_fails_its_requests_cleanly_and_the_survivor_serves(replicas):
    pids = replicas.replica_pids()
    assert len(pids) == 2, pids
    results: list = [None] * 6
    seen = [0] * 6
    # The kill comes once every stream has its first tokens, seen by its client: the proxy's metrics are up to a
    # push interval (2 s) old, and waiting for them to show all six running let a replica finish its requests
    # before the kill (under a second worker's load). The router spreads six requests over both replicas. It comes
    # as well once one stream has 32 events (a tenth of its tokens or less): under a second pytest worker the last
    # stream's first token once came after another stream had finished. A request not yet running then is failed
    # with the killed replica or served by the survivor, as a running one is.
    body = {"prompt": "def sort(items):", "max_tokens": 400, "ignore_eos": True}
    threads = [threading.Thread(target=_stream, args=(replicas.root, body, results, i), kwargs={"seen": seen})
               for i in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while min(seen) < 1 and max(seen) < 32:  # all admitted and running, or one well under way
        assert time.monotonic() < deadline, "the requests did not start"
        time.sleep(0.02)
    os.kill(pids[0], signal.SIGKILL)
    assert all(r is None for r in results), "a request finished before the kill"
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a request hangs"
    finished = failed = 0
    for status, events in results:
        assert status == 200 and events[-1] == "[DONE]", (status, events)
        if "error" in events[-2]:
            assert events[-2]["error"]["type"] == "service_unavailable", events[-2]
            failed += 1
        else:
            assert events[-2]["choices"][0]["finish_reason"] == "length"
            finished += 1
    assert failed >= 1 and finished >= 1, results  # the load was on both; only the killed one's failed
    after: list = [None] * 4
    for i in range(4):
        _stream(replicas.root, {"prompt": "def again(x):", "max_tokens": 8}, after, i)
    assert all(status == 200 and "error" not in events[-2] for status, events in after), after


def test_sigterm_lets_running_requests_finish_then_exits_0(replicas):
    body = {"prompt": "def last(x):", "max_tokens": 32, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", replicas.root + "/v1/completions", json=body, headers=AUTH, timeout=120) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        replicas.proc.send_signal(signal.SIGTERM)  # graceful: the running stream finishes
        events = [json.loads(line.removeprefix("data: ")) if line != "data: [DONE]" else "[DONE]"
                  for line in [first, *lines] if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length", events[-3:]
    assert sum(len(e["choices"][0]["text"]) > 0 for e in events[:-1]) >= 2
    status, log = replicas.stop()
    assert status == 0, log[-3000:]
    assert not replicas.replica_pids()
