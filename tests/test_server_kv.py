"""The KV pool seen from the server: ``/metrics`` reports pool usage, prefix-cache queries and hits under
vLLM's names, and the pool is back to empty after clients disconnect mid-stream (no block leaked), with a
greedy request's output the same before and after."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_server import TEMPLATE, Served, make_llm

from specdec.server import create_app


@pytest.fixture(scope="module")
def draft_dir(text_model_dirs, tmp_path_factory):
    from test_server import draft_dir as make_draft

    return make_draft.__wrapped__(text_model_dirs, tmp_path_factory)


@pytest.fixture(scope="module")
def server(text_model_dirs, draft_dir):
    served = Served(create_app(make_llm(text_model_dirs, draft_dir, "spec"), served_model_name="tiny", api_key="",
                               chat_template=TEMPLATE))
    yield served
    served.stop()


def _greedy(server: Served) -> str:
    return server.client().completions.create(model="tiny", prompt="for i in range(10):\n", max_tokens=25,
                                              temperature=0).choices[0].text


def test_prefix_cache_hits_and_pool_usage(server):
    server.settle()
    assert server.value("vllm:kv_cache_usage_perc") == 0
    assert server.value("specdec:kv_cache_blocks") > 0
    history = [{"role": "system", "content": "def f(x):\n    return x + 1\n" * 2},
               {"role": "user", "content": "for i in range(10):"}]
    client = server.client()
    first = client.chat.completions.create(model="tiny", messages=history, max_tokens=8, temperature=0)
    hits = server.value("vllm:prefix_cache_hits_total")
    queries = server.value("vllm:prefix_cache_queries_total")
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "print(i)"}]
    client.chat.completions.create(model="tiny", messages=history, max_tokens=8, temperature=0)
    assert server.value("vllm:prefix_cache_queries_total") > queries
    assert server.value("vllm:prefix_cache_hits_total") >= hits + 16  # at least a block of the first turn
    server.settle()
    assert server.value("vllm:kv_cache_usage_perc") == 0


def test_disconnected_clients_leak_no_block(server, monkeypatch):
    server.settle()
    before = _greedy(server)
    llm = server.state.llm
    step = llm.step

    def slow_step():  # slow enough for clients to leave mid-stream
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(llm, "step", slow_step)

    def one(i: int) -> None:
        body = {"prompt": f"x = {i}\n", "max_tokens": 60, "ignore_eos": True, "stream": True, "temperature": 1.0}
        with httpx.stream("POST", server.root + "/v1/completions", json=body, timeout=60) as response:
            for n, _ in enumerate(response.iter_lines()):
                if i % 3 == 0 and n == 3:  # a third of the clients leave after a few chunks
                    return

    with ThreadPoolExecutor(12) as pool:
        list(pool.map(one, range(12)))
    monkeypatch.setattr(llm, "step", step)
    server.settle()
    assert server.value("vllm:kv_cache_usage_perc") == 0
    assert all(p.num_used_blocks == 0 for p in llm.engine.kv_pools())
    assert _greedy(server) == before
