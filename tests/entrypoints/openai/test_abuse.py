"""One request must never take the server down, freeze it or exhaust its memory (a real `pagedllm serve`, its
engine core in its own process): requests that crashed the core are 400s, every size a client controls is
bounded before anything is allocated, heavy-but-allowed requests are prepared off the step loop (other streams
keep their pace), a many-prompt request is queued at once and withdrawn at once, a killed server leaves nothing
in the temp folder."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.utils import RemoteServer

C, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def srv(tiny_llm_dir: Path) -> Iterator[RemoteServer]:
    s = RemoteServer(tiny_llm_dir, "--served-model-name", "tiny", "--num-kv-blocks", "400", "--max-model-len", "512")
    yield s
    s.stop()


def _serves(srv: RemoteServer) -> None:
    assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
    r = httpx.post(f"{srv.url}{C}", json={"prompt": "hello", "max_tokens": 3, "ignore_eos": True}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def _refused(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


@pytest.mark.parametrize("body, param", [
    ({"prompt": "Hello", "max_tokens": 4, "seed": 2 ** 64 - 1, "n": 2}, "seed"),
    ({"prompt": "Hello", "max_tokens": 4, "seed": 2 ** 63 - 1, "n": 2}, "seed"),
    ({"prompt": "Hello", "max_tokens": 4, "n": 2, "use_beam_search": True, "length_penalty": -1e308}, "length_penalty"),
    ({"prompt": "Hello", "max_tokens": 4, "n": 2, "use_beam_search": True, "length_penalty": 1e308}, "length_penalty"),
])
def test_requests_that_killed_the_core_are_400s(srv: RemoteServer, body: dict, param: str) -> None:
    _refused(httpx.post(f"{srv.url}{C}", json=body, timeout=30), param)
    _serves(srv)


def test_an_infinite_length_penalty_is_400(srv: RemoteServer) -> None:
    body = '{"prompt": "Hello", "max_tokens": 4, "n": 2, "use_beam_search": true, "length_penalty": -Infinity}'
    r = httpx.post(f"{srv.url}{C}", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] in ("length_penalty", None), r.text
    _serves(srv)


def test_a_huge_n_is_refused_at_once_without_memory(srv: RemoteServer) -> None:
    api = psutil.Process(srv.proc.pid)
    before = api.memory_info().rss
    start = time.monotonic()
    r = httpx.post(f"{srv.url}{C}", json={"prompt": "Hello", "max_tokens": 4, "n": 10 ** 9}, timeout=30)
    elapsed = time.monotonic() - start
    _refused(r, "n")
    assert "max_num_seqs" in r.json()["error"]["message"]
    assert elapsed < 1.0, elapsed
    assert api.memory_info().rss - before < 50 * 2 ** 20
    _refused(httpx.post(f"{srv.url}{CHAT}", json={"messages": [{"role": "user", "content": "hi"}], "n": 257},
                        timeout=30), "n")


def test_a_huge_body_is_a_413_before_it_is_read(srv: RemoteServer) -> None:
    api = psutil.Process(srv.proc.pid)
    before = api.memory_info().rss
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:  # 1 GB declared, its start sent
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 1000000000\r\n\r\n" + b'{"prompt": "' + b"w" * 1000)
        reply = b""
        while chunk := sock.recv(65536):  # the server closes the connection after its answer
            reply += chunk
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 413") and '"code": "body_too_large"' in reply, reply[:300]
    # chunked, no length: cut off once past the cap (16 MiB by default)
    body = (b"x" * 2 ** 20 for _ in range(40))
    r = httpx.post(f"{srv.url}{C}", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert api.memory_info().rss - before < 50 * 2 ** 20
    _serves(srv)


@pytest.mark.parametrize("field, value, param", [
    ("stop", [f"s{i}" for i in range(65)], "stop"),
    ("stop", ["x" * 1025], "stop[0]"),
    ("bad_words", [f"w{i}" for i in range(257)], "bad_words"),
    ("logit_bias", {str(i): 1.0 for i in range(1025)}, "logit_bias"),
    ("allowed_token_ids", list(range(1025)), "allowed_token_ids"),
    ("prompt", ["a"] * 1025, "prompt"),
    ("prompt", ["a"] * 1024, "n"),  # with n=2 below: 2048 samples over --max-prompts
])
def test_each_size_over_its_limit_is_a_400_naming_it(srv: RemoteServer, field: str, value: Any, param: str) -> None:
    body = {"prompt": "Hello", "max_tokens": 2, field: value, **({"n": 2} if param == "n" else {})}
    _refused(httpx.post(f"{srv.url}{C}", json=body, timeout=30), param)


def test_too_many_tools_are_a_400(srv: RemoteServer) -> None:
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(129)]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "required"}
    _refused(httpx.post(f"{srv.url}{CHAT}", json=body, timeout=30), "tools")
    big = [{"type": "function", "function": {"name": "f", "description": "d" * 300_000, "parameters": {}}}]
    _refused(httpx.post(f"{srv.url}{CHAT}", json={**body, "tools": big}, timeout=30), "tools")


async def _stream_gaps(srv: RemoteServer, heavy: Callable[[httpx.AsyncClient], Awaitable[httpx.Response]]
                       ) -> tuple[float, httpx.Response]:
    """The largest gap between two tokens of a stream running while ``heavy`` is sent (and its response)."""
    async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
        body = {"prompt": "once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True,
                "temperature": 0}
        gaps: list[float] = []

        async def stream() -> None:
            last = None
            async with client.stream("POST", C, json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        now = time.monotonic()
                        if last is not None:
                            gaps.append(now - last)
                        last = now

        task = asyncio.ensure_future(stream())
        while not gaps:
            await asyncio.sleep(0.01)
        response = await heavy(client)
        await task
    return max(gaps), response


def _deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for i in range(depth):
        schema = {"type": "object", "properties": {f"k{i}": schema}, "required": [f"k{i}"]}
    return schema


HEAVY = {
    "bad_words": lambda c: c.post(C, json={"prompt": "hi", "max_tokens": 4,
                                           "bad_words": [f"word{i} and more" for i in range(256)]}),
    "stops": lambda c: c.post(C, json={"prompt": "hi", "max_tokens": 4, "stop": [f"stop{i}" * 8 for i in range(64)]}),
    "tools": lambda c: c.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                          "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": f"tool_{i}", "description": "does a thing " * 10, "parameters": {
            "type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}}}
        for i in range(128)]}),
    "choice": lambda c: c.post(C, json={"prompt": "hi", "max_tokens": 4, "structured_outputs": {  # ~60 KiB: both limits
        "choice": [f"option number {i:04d} of many, each about sixty bytes long...." for i in range(1024)]}}),
    "grammar": lambda c: c.post(C, json={"prompt": "hi", "max_tokens": 4, "structured_outputs": {  # ~1.5 s to compile
        "grammar": "root ::= " + " ".join(f'"{i:04d}" [a-z]*' for i in range(3500))}}),
    "deep_schema": lambda c: c.post(C, json={"prompt": "hi", "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "deep", "schema": _deep_schema(31)}}}),  # 63 levels of 64
}


@pytest.mark.parametrize("kind", sorted(HEAVY))
def test_heavy_allowed_requests_do_not_freeze_other_streams(srv: RemoteServer, kind: str) -> None:
    gap, response = asyncio.run(_stream_gaps(srv, HEAVY[kind]))
    print(f"{kind}: largest gap between a stream's tokens {gap:.3f} s")  # (pytest -s shows the figures)
    assert response.status_code == 200, response.text
    assert gap < 1.0, f"a stream waited {gap:.2f} s between two tokens while a {kind} request was prepared"


def test_a_many_prompt_request_is_queued_at_once_and_withdrawn_within_a_second(srv: RemoteServer) -> None:
    async def leave_early() -> None:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            body = {"prompt": [f"prompt number {i}" for i in range(200)], "max_tokens": 200, "ignore_eos": True}
            task = asyncio.ensure_future(client.post(C, json=body))
            deadline = time.monotonic() + 20
            while (await client.get("/stats")).json()["num_running"] < 100:  # one message: all queued together
                assert time.monotonic() < deadline, "the prompts were not queued at once"
                await asyncio.sleep(0.02)
            task.cancel()  # the client disconnects

    asyncio.run(leave_early())
    assert srv.wait_idle(within=5.0) < 1.0
    _serves(srv)


def test_a_request_timeout_covers_preparation(tiny_llm_dir: Path) -> None:
    s = RemoteServer(tiny_llm_dir, "--request-timeout", "0.05")
    try:
        choice = [f"a fresh choice {i} nobody compiled" for i in range(1024)]
        r = httpx.post(f"{s.url}{C}", json={"prompt": "hi", "max_tokens": 2, "structured_outputs": {"choice": choice}},
                       timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout", r.text
        s.wait_idle()
    finally:
        s.stop()


def test_sigkill_of_the_server_leaves_nothing_behind(tiny_llm_dir: Path) -> None:
    s = RemoteServer(tiny_llm_dir)
    core = psutil.Process(s.proc.pid).children()
    try:
        # the core's command line names its ipc folder (ipc://<temp>/pagedllm-core-XXXX/commands)
        (folder,) = {os.path.dirname(arg.removeprefix("ipc://")) for p in core for arg in p.cmdline()
                     if arg.startswith("ipc://")}
        assert os.path.basename(folder).startswith("pagedllm-core-") and folder.startswith(tempfile.gettempdir())
        assert not os.path.exists(folder)  # the socket files are gone once the core is connected
    finally:
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait(10)
    gone, alive = psutil.wait_procs(core, timeout=10)
    assert not alive and not os.path.exists(folder)
