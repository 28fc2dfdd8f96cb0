"""vLLM's development routes through a real `pagedllm serve` (issue 45): sleep / wake_up / is_sleeping with
--enable-sleep-mode, pause / resume / is_paused in their three modes, and /collective_rpc with
--worker-extension-cls, all only with VLLM_SERVER_DEV_MODE=1 (404 on the session server without it)."""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.utils import RemoteServer


@pytest.fixture(scope="module")
def dev(tiny_llm_dir: Path) -> Iterator[RemoteServer]:
    srv = RemoteServer(tiny_llm_dir, "--served-model-name", "tiny", "--enable-sleep-mode",
                       "--enable-prompt-tokens-details", "--num-kv-blocks", "128",
                       "--worker-extension-cls", "tests.engine.test_sleep.Extension",
                       env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"})
    yield srv
    srv.stop()


def post(srv: RemoteServer, path: str, **kw: Any) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", timeout=60, **kw)


def get(srv: RemoteServer, path: str) -> Any:
    return httpx.get(f"{srv.url}{path}", timeout=10).json()


def complete(srv: RemoteServer, max_tokens: int = 4) -> httpx.Response:
    return post(srv, "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": max_tokens})


class Stream:
    """A long streamed completion in a thread: its chunks and finish reason."""

    def __init__(self, srv: RemoteServer) -> None:
        self.chunks: list[dict] = []
        self.finish: str | None = None
        self.started, self.done = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(srv,))
        self.thread.start()
        assert self.started.wait(30) and not self.done.is_set()

    def _run(self, srv: RemoteServer) -> None:
        body = {"model": "tiny", "prompt": "Count:", "max_tokens": 100, "ignore_eos": True, "stream": True,
                "logprobs": 20}  # (20 alternatives a token: a step slow enough to pause in the middle)
        try:
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        self.chunks.append(chunk)
                        self.started.set()
                        self.finish = chunk["choices"][0]["finish_reason"] or self.finish
        finally:
            self.started.set()
            self.done.set()


def usage_of_rank0(srv: RemoteServer) -> dict:
    response = post(srv, "/collective_rpc", json={"method": "memory_usage"})
    assert response.status_code == 200, response.text
    return response.json()["results"][0]


def sleep_metric(srv: RemoteServer, state: str) -> float:
    for line in httpx.get(f"{srv.url}/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:engine_sleep_state{") and f'sleep_state="{state}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(state)


def test_routes_exist_only_in_dev_mode(server: RemoteServer) -> None:
    for path in ("/sleep", "/release_kv_cache_memory", "/wake_up", "/pause", "/resume", "/collective_rpc"):
        assert post(server, path).status_code == 404
    assert httpx.get(f"{server.url}/is_sleeping", timeout=10).status_code == 404


def test_sleep_frees_the_pool_and_requests_wait_for_the_wake_up(dev: RemoteServer) -> None:
    kv = usage_of_rank0(dev)["kv_cache_bytes"]
    assert kv > 0 and get(dev, "/is_sleeping") == {"is_sleeping": False}
    assert post(dev, "/sleep", params={"level": "1"}).json() == {"status": "sleeping", "level": 1}
    assert get(dev, "/is_sleeping") == {"is_sleeping": True}
    assert usage_of_rank0(dev)["kv_cache_bytes"] == 0  # the pool's memory is gone
    assert sleep_metric(dev, "weights_offloaded") == 1 and sleep_metric(dev, "awake") == 0
    waiting: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: waiting.append(complete(dev)))
    thread.start()
    time.sleep(0.5)
    assert not waiting  # held while asleep
    assert post(dev, "/wake_up", params={"tags": "weights"}).json() == {"status": "sleeping", "tags": ["weights"]}
    assert get(dev, "/is_sleeping") == {"is_sleeping": True}
    assert post(dev, "/wake_up", params={"tags": ["kv_cache"]}).json() == {"status": "awake", "tags": ["kv_cache"]}
    thread.join(30)
    assert waiting and waiting[0].status_code == 200, waiting
    assert usage_of_rank0(dev)["kv_cache_bytes"] == kv and sleep_metric(dev, "awake") == 1

    weights = usage_of_rank0(dev)["weights_bytes"]
    assert post(dev, "/release_kv_cache_memory").json() == {"status": "kv_cache_released"}  # vLLM's level 1
    assert get(dev, "/is_sleeping") == {"is_sleeping": True}
    assert usage_of_rank0(dev)["kv_cache_bytes"] == 0 and usage_of_rank0(dev)["weights_bytes"] == weights
    assert post(dev, "/wake_up", params={"tags": ["kv_cache"]}).json()["status"] == "awake"
    assert complete(dev).status_code == 200

    assert post(dev, "/sleep", params={"level": "2"}).status_code == 200  # the weights go too
    assert usage_of_rank0(dev)["weights_bytes"] == 0
    assert post(dev, "/wake_up").json() == {"status": "awake", "tags": None}
    assert complete(dev).status_code == 200


@pytest.mark.parametrize(("query", "param"), [("level=3", "query.level"), ("level=x", "query.level"),
                                              ("mode=later", "query.mode"), ("reset_connector=maybe",
                                                                             "query.reset_connector")])
def test_bad_sleep_queries_are_400_naming_them(dev: RemoteServer, query: str, param: str) -> None:
    response = post(dev, f"/sleep?{query}")
    assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert get(dev, "/is_sleeping") == {"is_sleeping": False}


@pytest.mark.parametrize(("mode", "finish"), [("abort", "abort"), ("wait", "length"), ("keep", "length")])
def test_pause_modes(dev: RemoteServer, mode: str, finish: str) -> None:
    stream = Stream(dev)
    try:
        assert post(dev, "/pause", params={"mode": mode}).json() == {"status": "paused"}
        assert get(dev, "/is_paused") == {"is_paused": True}
        if mode == "keep":  # frozen: no chunk comes, a new request waits
            seen = len(stream.chunks)
            assert not stream.done.wait(0.5) and len(stream.chunks) == seen
            late: list[httpx.Response] = []
            thread = threading.Thread(target=lambda: late.append(complete(dev)))
            thread.start()
            time.sleep(0.3)
            assert not late
        else:  # ended, or finished, before the pause answered; new requests are refused with vLLM's 503
            assert stream.done.wait(5)
            refused = complete(dev)
            assert refused.status_code == 503
            assert refused.json()["error"]["type"] == "ServiceUnavailableError"
    finally:
        assert post(dev, "/resume").json() == {"status": "resumed"}
    stream.thread.join(60)
    assert stream.finish == finish and get(dev, "/is_paused") == {"is_paused": False}
    if mode == "keep":
        thread.join(30)
        assert late and late[0].status_code == 200
    assert complete(dev).status_code == 200
    assert post(dev, "/pause?mode=sometimes").json()["error"]["param"] == "query.mode"


def test_collective_rpc(dev: RemoteServer) -> None:
    response = post(dev, "/collective_rpc", json={"method": "echo", "args": ["a", 1], "kwargs": {"k": "v"}})
    assert response.json() == {"results": [{"args": ["a", 1], "kwargs": {"k": "v"}, "ready": True}]}
    for body, param in (({"method": "no_such"}, "method"), ({"method": "_private"}, "method"),
                        ({"method": "echo", "args": "x"}, "args"), ({"method": "echo", "extra": 1}, "extra")):
        response = post(dev, "/collective_rpc", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    response = post(dev, "/collective_rpc", json={"method": "fail"})
    assert response.status_code == 500 and "the extension failed" in response.json()["error"]["message"]
    assert complete(dev).status_code == 200  # one failed call fails alone
