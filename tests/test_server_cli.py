"""``specdec serve`` as a process: it serves the embedded pair with no MODEL, and SIGTERM lets a
running request finish, refuses new connections, and exits with status 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from specdec.assets import default_pair

pytestmark = pytest.mark.skipif(default_pair() is None, reason="the embedded default pair is not shipped")


def test_sigterm_drains_running_requests_then_exits_0():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "serve", "--port", str(port), "--speculative-method", "none",
         "--max-num-seqs", "2", "--graceful-timeout", "60", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.communicate()[1]
            try:
                if httpx.get(root + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        assert httpx.get(root + "/v1/models").json()["data"][0]["id"] == "specdec-default-pair"
        chat = httpx.post(root + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "sort a list"}], "max_tokens": 4, "temperature": 0})
        assert chat.status_code == 200, chat.text  # the embedded pair's shipped template
        assert chat.json()["choices"][0]["message"]["role"] == "assistant"
        text, finish, tokens = "", None, 0
        body = {"prompt": "def quicksort(arr):\n", "max_tokens": 100, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", root + "/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            first = next(lines)
            process.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError):  # no longer admitting
                httpx.get(root + "/health")
            for line in [first, *lines]:
                data = line.removeprefix("data: ")
                if not line.startswith("data: ") or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if chunk["choices"]:
                    text += chunk["choices"][0]["text"]
                    finish = chunk["choices"][0]["finish_reason"] or finish
                else:
                    tokens = chunk["usage"]["completion_tokens"]
        assert finish == "length" and tokens == 100 and text
        assert process.wait(timeout=60) == 0
        assert "specdec serve: 'specdec-default-pair'" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_ctrl_c_drains_and_a_second_one_ends_the_streams_with_an_answer():
    """Ctrl+C drains as SIGTERM does and exits 0 (not 130); a second one while draining ends the running stream
    at once with an error event and ``[DONE]``, never cut mid-body, and nothing in the log is a traceback."""
    from serve_process import ServeProcess

    server = ServeProcess("--speculative-method", "none", "--max-num-seqs", "1", "--graceful-timeout", "60")
    body = {"prompt": "def quicksort(arr):\n", "max_tokens": 480, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", server.root + "/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            next(lines)
            server.proc.send_signal(signal.SIGINT)
            time.sleep(0.3)
            server.proc.send_signal(signal.SIGINT)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert error["type"] == "service_unavailable" and "stopped a second time" in error["message"]
        assert server.proc.wait(timeout=60) == 0
    finally:
        status, log = server.stop()
    assert status == 0 and "Traceback" not in log, log[-3000:]
