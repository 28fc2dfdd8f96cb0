"""Shutdown under load, and /health once the engine loop has died."""
from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from tests.utils import RemoteServer, thread_engine


def test_sigterm_under_load_exits_0_quickly(tiny_llm_dir: Path) -> None:
    srv = RemoteServer(tiny_llm_dir)
    started = threading.Event()
    statuses: list[int] = []

    def client(i: int) -> None:
        body = {"prompt": f"load {i}", "max_tokens": 500, "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as r:
                statuses.append(r.status_code)
                for _ in r.iter_lines():
                    started.set()
        except httpx.HTTPError:
            pass  # the server went away mid-stream: expected

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(12)]
    for t in threads:
        t.start()
    try:
        assert started.wait(30)
        time.sleep(0.5)
        assert srv.metric("pagedllm:num_requests_running") > 0
        sent = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(timeout=10)
        assert code == 0 and time.monotonic() - sent < 10
        assert statuses and all(s == 200 for s in statuses)
    finally:
        srv.stop()


def test_health_is_503_once_the_engine_loop_died(tiny_llm_dir: Path) -> None:
    engine = thread_engine(tiny_llm_dir)
    metrics = ServerMetrics("tiny")
    app = build_app(engine, metrics, ["tiny"], [])

    def broken_step() -> None:
        raise RuntimeError("simulated device failure")

    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        engine.client.core.step = broken_step
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        assert client.get("/health").status_code == 503
        again = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert again.status_code == 503


@pytest.mark.parametrize("stream", [False, True])
def test_in_process_app_serves(tiny_llm_dir: Path, stream: bool) -> None:
    """The same app in-process (TestClient): a plain request and a stream, then a clean shutdown."""
    engine = thread_engine(tiny_llm_dir)
    with TestClient(build_app(engine, ServerMetrics("tiny"), ["tiny"], [])) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": stream,
                                                 "ignore_eos": True})
        assert r.status_code == 200
        if stream:
            assert r.text.rstrip().endswith("data: [DONE]")
        else:
            assert r.json()["usage"]["completion_tokens"] == 3
    assert not engine.is_running
