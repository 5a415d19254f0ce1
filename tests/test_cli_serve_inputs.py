"""Bad inputs of ``specdec serve`` and ``specdec bench-serve``: each is exit status 2 and one line on stderr,
before any model loads (a port out of range or in use, a host that is no address here, a chat template with a
syntax error, an empty API key, negative timeouts and thresholds); ``--port 0`` serves on a free port and says
which; a load test in which every request fails exits 1, not 0."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

import specdec.llm
from specdec.assets import default_pair
from specdec.cli import main
from specdec.errors import SpecDecError
from specdec.server.cli import bind_sockets, listen, read_chat_template, resolved_api_key
from specdec.server.loadgen import run_failure

needs_pair = pytest.mark.skipif(default_pair() is None, reason="the embedded default pair is not shipped")


def one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"specdec {command}: error: "), err[0]
    return err[0]


def parse_exit(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return exc.value.code


@pytest.mark.parametrize("argv, message", [
    (["--port", "70000"], "argument --port: must be in 0..65535 (0: any free port), got 70000"),
    (["--port", "65536"], "argument --port: must be in 0..65535"),
    (["--port", "-1"], "argument --port: must be in 0..65535 (0: any free port), got -1"),
    (["--port", "80.5"], "argument --port: invalid int value: '80.5'"),
    (["--graceful-timeout", "-1"], "argument --graceful-timeout: must be a finite number >= 0, got -1"),
    (["--graceful-timeout", "nan"], "argument --graceful-timeout: must be a finite number >= 0, got nan"),
    (["--served-model-name", ""], "argument --served-model-name: is empty"),
    (["--served-model-name", "  "], "argument --served-model-name: is empty"),
    (["--api-key", ""], "argument --api-key: is empty; omit it to serve without a key"),
    (["--max-queue-len", "-1"], "argument --max-queue-len: must be >= 0, got -1"),
    (["--max-request-bytes", "0"], "argument --max-request-bytes: must be >= 1, got 0"),
])
def test_serve_refuses_bad_flags_when_parsing(argv, message, capsys):
    assert parse_exit(["serve", *argv]) == 2
    assert message in one_error_line(capsys, "serve")


def test_serve_parses_the_edges_of_the_ranges():
    from specdec.cli import build_parser

    args = build_parser().parse_args(["serve", "--port", "0", "--graceful-timeout", "0", "--api-key", "k",
                                      "--served-model-name", "m", "--max-queue-len", "0"])
    assert (args.port, args.graceful_timeout, args.api_key, args.served_model_name) == (0, 0.0, "k", "m")
    assert build_parser().parse_args(["serve", "--port", "65535"]).port == 65535
    assert build_parser().parse_args(["serve"]).api_key is None  # the variable is read at run time


def test_an_empty_api_key_variable_means_no_key_and_a_blank_one_is_refused():
    assert resolved_api_key(None, {}) is None
    assert resolved_api_key(None, {"SPECDEC_API_KEY": ""}) is None
    assert resolved_api_key(None, {"SPECDEC_API_KEY": "sekret"}) == "sekret"
    assert resolved_api_key("flag", {"SPECDEC_API_KEY": "sekret"}) == "flag"
    with pytest.raises(SpecDecError, match=r"\$SPECDEC_API_KEY is blank"):
        resolved_api_key(None, {"SPECDEC_API_KEY": "  "})


def busy_port() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


def test_a_port_in_use_or_a_bad_host_cannot_be_bound():
    held, port = busy_port()
    with held, pytest.raises(SpecDecError, match=f"^cannot listen on 127.0.0.1:{port}: address already in use$"):
        bind_sockets("127.0.0.1", port)
    with pytest.raises(SpecDecError, match="^cannot listen on 999.999.1.1:8000: "):
        bind_sockets("999.999.1.1", 8000)


def test_port_0_binds_a_free_port_and_a_late_listener_on_the_same_port_is_refused():
    first = bind_sockets("127.0.0.1", 0)
    port = first[0].getsockname()[1]
    assert port != 0
    second = bind_sockets("127.0.0.1", port)  # neither listens yet: both binds succeed (SO_REUSEADDR) ...
    try:
        listen(first, "127.0.0.1", port)
        with pytest.raises(SpecDecError, match=f"cannot listen on 127.0.0.1:{port}: address already in use"):
            listen(second, "127.0.0.1", port)  # ... the one that listens second is refused, in one line
    finally:
        for sock in first + second:
            sock.close()


@pytest.fixture
def no_model_load(monkeypatch):
    """``specdec serve`` must fail before it builds its LLM."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was found")

    monkeypatch.setattr(specdec.llm, "LLM", refuse)


@needs_pair
def test_serve_on_a_port_in_use_or_a_bad_host_exits_2_before_loading(no_model_load, capsys):
    held, port = busy_port()
    with held:
        assert main(["serve", "--port", str(port)]) == 2
    assert one_error_line(capsys, "serve") == (
        f"specdec serve: error: cannot listen on 127.0.0.1:{port}: address already in use")
    assert main(["serve", "--host", "999.999.1.1"]) == 2
    assert "cannot listen on 999.999.1.1:8000: " in one_error_line(capsys, "serve")


def test_a_chat_template_with_a_syntax_error_is_refused_at_start(tmp_path, no_model_load, capsys):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }\n", encoding="utf-8")
    assert main(["serve", "--chat-template", str(bad)]) == 2
    line = one_error_line(capsys, "serve")
    assert f"--chat-template {str(bad)!r} is not a valid Jinja template: line 1: " in line
    unclosed = tmp_path / "unclosed.jinja"
    unclosed.write_text("{% for m in messages %}\n{{ m.content }}\n", encoding="utf-8")
    with pytest.raises(SpecDecError, match=r"unclosed.jinja' is not a valid Jinja template: line \d+: "):
        read_chat_template(unclosed)
    latin = tmp_path / "latin.jinja"
    latin.write_bytes(b"caf\xe9 {{ messages }}")
    with pytest.raises(SpecDecError, match="cannot read --chat-template .*: not UTF-8 text"):
        read_chat_template(latin)


def test_a_valid_chat_template_is_read_as_transformers_renders_it(tmp_path):
    """The loop controls of transformers' Jinja environment compile (``{% break %}``)."""
    good = tmp_path / "good.jinja"
    text = "{% for m in messages %}{{ m['content'] }}{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}"
    good.write_text(text, encoding="utf-8")
    assert read_chat_template(good) == text


@needs_pair
def test_a_blank_api_key_variable_exits_2(monkeypatch, no_model_load, capsys):
    monkeypatch.setenv("SPECDEC_API_KEY", " ")
    assert main(["serve"]) == 2
    assert "$SPECDEC_API_KEY is blank" in one_error_line(capsys, "serve")


@needs_pair
def test_serve_on_port_0_announces_the_port_it_listens_on():
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed below
    process = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--port", "0", "--speculative-method",
                                "none", "--max-num-seqs", "2"], stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            log.seek(0)
            output = log.read()
            bound = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+) ", output)
            if bound:
                break
            assert process.poll() is None, output
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        port = int(bound.group(1))
        assert port != 0 and f"at http://127.0.0.1:{port}/v1" in output
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()


@pytest.mark.parametrize("argv, message", [
    (["--max-tokens", "0"], "argument --max-tokens: must be >= 1, got 0"),
    (["--temperature", "-1"], "argument --temperature: must be a finite number >= 0, got -1"),
    (["--temperature", "inf"], "argument --temperature: must be a finite number >= 0, got inf"),
    (["--num-requests", "0"], "argument --num-requests: must be >= 1, got 0"),
    (["--num-prompts", "0"], "argument --num-prompts: must be >= 1, got 0"),
    (["--warmup", "-1"], "argument --warmup: must be >= 0, got -1"),
    (["--disconnect-fraction", "1.5"], "argument --disconnect-fraction: must be a finite number in 0..1, got 1.5"),
    (["--in-process", "--goodput-ttft-ms", "-5"], "argument --goodput-ttft-ms: must be a finite number >= 0, got -5"),
    (["--in-process", "--goodput-itl-ms", "-1"], "argument --goodput-itl-ms: must be a finite number >= 0, got -1"),
])
def test_bench_serve_refuses_values_a_server_would_reject_when_parsing(argv, message, capsys):
    assert parse_exit(["bench-serve", *argv]) == 2
    assert message in one_error_line(capsys, "bench-serve")


def row(completed: int, errors: int, disconnected: int = 0, first: tuple[str, ...] = ()) -> dict:
    return {"requests": completed + errors + disconnected, "completed": completed, "errors": errors,
            "disconnected": disconnected, "first_errors": list(first)}


def test_a_run_fails_when_no_request_completed_and_some_failed():
    url = "http://127.0.0.1:8000/v1"
    assert run_failure([row(3, 1, first=("HTTP 500: x",))], url) is None
    assert run_failure([row(0, 0, disconnected=8)], url) is None  # --disconnect-fraction 1: a soak test
    assert run_failure([row(0, 8, first=("HTTP 400: bad\nvalue",)), row(0, 8, first=("HTTP 400: b",))], url) == (
        "all 16 requests failed; the first: HTTP 400: bad value")
    assert run_failure([row(0, 2, disconnected=6, first=("HTTP 429: full",))], url) == (
        "no request completed: 2 of 8 failed, the others disconnected; the first: HTTP 429: full")
    assert run_failure([row(0, 1, first=("HTTP 404: not found",))], "http://h:1").endswith(
        "(--base-url http://h:1 does not end in /v1)")


def test_bench_serve_exits_1_when_the_server_rejects_every_request(text_model_dirs, tmp_path, capsys, monkeypatch):
    from test_server import PLAIN, TEMPLATE, Served, make_llm

    import specdec.train.corpus
    from specdec.server import create_app

    monkeypatch.setattr(specdec.train.corpus, "code_prompts", lambda n, seed: [f"x = {i}\n" for i in range(n)])
    served = Served(create_app(make_llm(text_model_dirs, None, PLAIN), served_model_name="tiny", api_key="",
                               chat_template=TEMPLATE))
    common = ["--concurrency", "2", "--num-requests", "3", "--max-tokens", "2", "--warmup", "0", "--num-prompts", "2"]
    try:
        assert main(["bench-serve", "--base-url", served.root + "/v1", "--model", "wrongname", *common]) == 1
        captured = capsys.readouterr()
        assert "c=2   0/3 ok" in captured.out
        last = captured.err.strip().splitlines()[-1]
        assert last.startswith("specdec bench-serve: error: all 3 requests failed; the first: HTTP 404: ")
        assert "wrongname" in last
        assert main(["bench-serve", "--base-url", served.root, *common]) == 1
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("specdec bench-serve: error: all 3 requests failed; the first: HTTP 404")
        assert last.endswith(f"(--base-url {served.root} does not end in /v1)")
        assert main(["bench-serve", "--base-url", served.root + "/v1", "--model", "tiny", *common]) == 0
    finally:
        served.stop()
