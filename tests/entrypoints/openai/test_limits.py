"""Load shedding and limits of `pagedllm serve`: --max-waiting-requests (503 + Retry-After, the admitted
requests undisturbed), --request-timeout (504, or an error event on a stream; the request's blocks freed),
--max-prompt-bytes (400 before tokenizing), and 400s for requests that could never fit."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.utils import RemoteServer, with_context

C = "/v1/completions"


@pytest.fixture(scope="module")
def limited(tiny_llm_dir: Path) -> Iterator[RemoteServer]:
    srv = RemoteServer(tiny_llm_dir, "--max-waiting-requests", "4", "--max-num-seqs", "2", "--max-prompt-bytes",
                       "2000", "--num-kv-blocks", "20")
    yield srv
    srv.stop()


def test_over_the_waiting_limit_503_with_retry_after(limited: RemoteServer) -> None:
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=40)) as client:
            body = {"prompt": "one two three", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
            return await asyncio.gather(*(client.post(f"{limited.url}{C}", json=body) for _ in range(30)))

    responses = asyncio.run(burst())
    shed = [r for r in responses if r.status_code == 503]
    served = [r for r in responses if r.status_code == 200]
    assert len(shed) + len(served) == 30 and shed and len(served) >= 4  # at least the 4 the queue holds
    for r in shed:
        assert r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert error["code"] == "overloaded" and error["type"] == "server_error" and "4 waiting" in error["message"]
    for r in served:  # the admitted ones ran to the end, undisturbed
        assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 24
    assert limited.metric('pagedllm:requests_refused_total{model_name="' + str(limited_model(limited)) + '",'
                          'reason="overloaded"}') == len(shed)
    limited.wait_idle()
    assert httpx.post(f"{limited.url}{C}", json={"prompt": "hi", "max_tokens": 2}, timeout=30).status_code == 200


def limited_model(srv: RemoteServer) -> str:
    return httpx.get(f"{srv.url}/v1/models", timeout=5).json()["data"][0]["id"]


@pytest.mark.parametrize("path, body, param", [
    (C, {"prompt": "x" * 2001, "max_tokens": 2}, "prompt"),
    (C, {"prompt": ["short", "é" * 1001], "max_tokens": 2}, "prompt"),  # 2002 bytes over two prompts
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 2001}], "max_tokens": 2}, "messages"),
    (C, {"prompt": "hi", "max_tokens": 600}, "max_tokens"),  # over max_model_len (512)
    (C, {"prompt": "hi", "max_tokens": 500}, "max_tokens"),  # fits the context, not the 19-block pool (304 tokens)
    (C, {"prompt": ["a", "b", "c", "d", "e"], "max_tokens": 2}, "prompt"),  # more prompts than the queue holds
])
def test_requests_that_could_never_run_are_400s(limited: RemoteServer, path: str, body: dict, param: str) -> None:
    r = httpx.post(f"{limited.url}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_request_timeout_aborts_and_frees_the_blocks(tiny_llm_dir: Path, tmp_path: Path) -> None:
    # An 8k context: 480 tokens of the tiny model took under 0.3 s on a fast CI machine; 8,000 cannot.
    srv = RemoteServer(with_context(tiny_llm_dir, tmp_path, 8192), "--request-timeout", "0.3", "--max-model-len",
                       "8192")
    try:
        body = {"prompt": "slow", "max_tokens": 8000, "ignore_eos": True, "temperature": 0}
        start = time.monotonic()
        r = httpx.post(f"{srv.url}{C}", json=body, timeout=30)
        assert r.status_code == 504 and time.monotonic() - start < 5
        assert r.json()["error"]["code"] == "request_timeout" and "0.3 s" in r.json()["error"]["message"]
        with httpx.stream("POST", f"{srv.url}{C}", json={**body, "stream": True}, timeout=30) as stream:
            assert stream.status_code == 200  # the status line went out before the deadline
            events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "request_timeout"
        assert len(events) > 3  # tokens came before the deadline
        srv.wait_idle()
        quick = httpx.post(f"{srv.url}{C}", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert quick.status_code == 200
        assert srv.metric('pagedllm:requests_refused_total{model_name="' + limited_model(srv) + '",'
                          'reason="timeout"}') == 2
    finally:
        srv.stop()


def test_limits_are_checked_at_start(tiny_llm_dir: Path) -> None:
    import subprocess
    import sys

    for flag, value in (("--max-waiting-requests", "0"), ("--request-timeout", "-1"), ("--max-prompt-bytes", "x")):
        done = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(tiny_llm_dir), flag,
                               value], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and flag in done.stderr, done.stderr
