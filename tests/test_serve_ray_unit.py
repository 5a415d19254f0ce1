"""The pieces of scale-out that need no Ray instance: the proxy's error middleware on fake ASGI apps,
the board's merged metrics, the replica settings, and the CLI's refusals (``--replicas`` without ray
installed, replica flags without ``--replicas``)."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from specdec.cli import main
from specdec.serve_ray.board import Board, labelled
from specdec.serve_ray.proxy import REPLICA_LOST, OpenAIErrors


def _run(app, scope_type: str = "http") -> list[dict]:
    """Call ``OpenAIErrors(app)`` once; the messages it sent."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": scope_type, "method": "POST", "path": "/v1/completions", "headers": []}
    asyncio.run(OpenAIErrors(app)(scope, receive, send))
    return sent


def _start(status: int, kind: bytes) -> dict:
    return {"type": "http.response.start", "status": status, "headers": [(b"content-type", kind)]}


def _body(messages: list[dict]) -> bytes:
    return b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")


def test_a_replica_lost_before_answering_is_a_503_in_openai_shape():
    async def dies(scope, receive, send):  # what the proxy does when the replica dies: sends nothing
        return None

    sent = _run(dies)
    assert sent[0]["status"] == 503
    assert json.loads(_body(sent)) == {"error": {"message": REPLICA_LOST, "type": "service_unavailable",
                                                 "param": None, "code": None}}
    assert sent[-1]["more_body"] is False


def test_a_stream_cut_short_ends_with_an_error_event_then_done():
    async def cut(scope, receive, send):
        await send(_start(200, b"text/event-stream; charset=utf-8"))
        await send({"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True})
        raise RuntimeError("the replica died")  # (the proxy itself swallows it; either way)

    with pytest.raises(RuntimeError):
        _run(cut)

    async def ends(scope, receive, send):  # the proxy ends the body without [DONE]
        await send(_start(200, b"text/event-stream"))
        await send({"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    sent = _run(ends)
    events = [e for e in _body(sent).decode().split("\n\n") if e]
    assert events[0] == 'data: {"choices": []}'
    assert json.loads(events[1].removeprefix("data: "))["error"]["type"] == "service_unavailable"
    assert events[2] == "data: [DONE]"
    assert sent[-1]["more_body"] is False and sum(not m.get("more_body", False) for m in sent[1:]) == 1


def test_complete_responses_pass_unchanged():
    async def stream(scope, receive, send):
        await send(_start(200, b"text/event-stream"))
        await send({"type": "http.response.body", "body": b"data: {}\n\ndata: [DO", "more_body": True})
        await send({"type": "http.response.body", "body": b"NE]\n\n", "more_body": False})

    assert _body(_run(stream)) == b"data: {}\n\ndata: [DONE]\n\n"

    async def error(scope, receive, send):  # the app's own errors are in OpenAI's shape already
        await send(_start(429, b"application/json"))
        await send({"type": "http.response.body", "body": b'{"error": {"type": "x"}}'})

    sent = _run(error)
    assert sent[0]["status"] == 429 and _body(sent) == b'{"error": {"type": "x"}}'


def test_plain_text_errors_of_the_proxy_get_openai_shape():
    async def not_found(scope, receive, send):
        await send(_start(404, b"text/plain"))
        await send({"type": "http.response.body", "body": b"Path '/v2' not found.", "more_body": False})

    sent = _run(not_found)
    assert sent[0]["status"] == 404
    assert json.loads(_body(sent))["error"] == {"message": "Path '/v2' not found.", "type": "invalid_request_error",
                                                "param": None, "code": None}


def _registry(value: float) -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("vllm:generation_tokens", "Tokens.", ["model_name"], registry=registry).labels("m").inc(value)
    return registry


def test_board_merges_the_replicas_metrics_with_a_replica_label_and_drops_stale_ones():
    board = Board(push_interval=0.05)
    board.push("a", labelled(_registry(3), "a"), True)
    board.push("b", labelled(_registry(5), "b"), False)
    families = {f.name: f for f in text_string_to_metric_families(board.metrics().decode())}
    samples = {s.labels["replica"]: s.value for s in families["vllm:generation_tokens"].samples
               if s.name.endswith("_total")}
    assert samples == {"a": 3.0, "b": 5.0}
    assert board.metrics().decode().count("# TYPE vllm:generation_tokens_total counter") == 1  # one family
    assert board.health() == {"a": True, "b": False}
    import time

    time.sleep(0.2)  # > 3 push intervals: both are stale
    board.push("a", labelled(_registry(4), "a"), True)
    assert board.health() == {"a": True}
    board.leave("a")
    assert board.health() == {}


def test_replica_flags_need_replicas(capsys):
    assert main(["serve", "--max-replicas", "3"]) == 2
    assert "--max-replicas only apply with --replicas N" in capsys.readouterr().err


def test_replicas_without_ray_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # importing ray raises ImportError
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    assert main(["serve", "--replicas", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'specdec[ray]'" in err[0]


def test_replica_settings_are_checked():
    pytest.importorskip("ray.serve")
    from specdec.errors import SpecDecError
    from specdec.serve_ray import ReplicaSettings

    with pytest.raises(SpecDecError, match="num_replicas must be an integer >= 1"):
        ReplicaSettings(num_replicas=0)
    with pytest.raises(SpecDecError, match="give max_replicas too"):
        ReplicaSettings(min_replicas=1)
    with pytest.raises(SpecDecError, match="min_replicas \\(2\\) <= num_replicas"):
        ReplicaSettings(num_replicas=1, min_replicas=2, max_replicas=4)
    fixed = ReplicaSettings(num_replicas=2, num_cpus=0.5).deployment_options(max_num_seqs=16)
    assert fixed["num_replicas"] == 2 and fixed["max_ongoing_requests"] == 16
    assert fixed["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0.0}
    scaled = ReplicaSettings(num_replicas=2, min_replicas=1, max_replicas=4, target_ongoing_requests=8,
                             max_ongoing_requests=32).deployment_options(max_num_seqs=16)
    assert "num_replicas" not in scaled and scaled["max_ongoing_requests"] == 32
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "initial_replicas": 2, "max_replicas": 4,
                                           "target_ongoing_requests": 8}
    assert ReplicaSettings(num_cpus=1.5).torch_threads == 2
