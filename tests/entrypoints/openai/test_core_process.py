"""`pagedllm serve` runs its engine core in a child process (ZeroMQ + msgpack): what crosses the boundary.

Every other server test runs through the core process too (it is the default); these check what only
it can get wrong: a killed core, stop strings found in the API process while the core runs on, and
the thread mode kept behind PAGEDLLM_ENABLE_MULTIPROCESSING=0.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import psutil

from tests.distributed.test_faults import _assert_gone, kill_under_load
from tests.utils import RemoteServer


def _core(srv: RemoteServer) -> list[psutil.Process]:
    return [p for p in psutil.Process(srv.proc.pid).children()
            if "pagedllm.engine.core_proc" in " ".join(p.cmdline())]


def test_killed_core_fails_the_server(tiny_llm_dir: Path) -> None:
    """SIGKILL the core under load: /health 503, every stream ends in an error, the server exits non-zero and
    leaves nothing behind."""
    srv = RemoteServer(tiny_llm_dir)
    try:
        core = _core(srv)
        assert len(core) == 1, psutil.Process(srv.proc.pid).children()
        everything = psutil.Process(srv.proc.pid).children(recursive=True)
        dead = kill_under_load(srv, core[0])
        output, health = dead.output, dead.health
        assert dead.code != 0, output
        assert 503 in health and 200 not in health[health.index(503):], (health, output)
        assert dead.refused[0].status_code == 503, dead.refused[0].text
        error = dead.refused[0].json()["error"]  # one code to match, and the reason said once
        assert error["type"] == "server_error" and error["code"] == "engine_dead", error
        assert error["message"] == "the engine is not running: the engine core process exited with status -9", error
        assert len(dead.errors) == 4 and max(dead.errors) - dead.killed_at < 10, (dead.errors, dead.killed_at)
        assert "the engine core process exited with status -9" in output, output[-3000:]
        _assert_gone(everything)
    finally:
        srv.stop()


def test_stop_strings_and_n_cross_the_boundary(server: RemoteServer) -> None:
    """Stop strings are found where the text is (the API process) while the core may run a step on: the text
    still ends before them, and no sample keeps a block afterwards."""
    body = {"model": "tiny", "prompt": "stop strings", "max_tokens": 48, "n": 3, "temperature": 1.0, "seed": 7,
            "stop": ["e", "a"], "ignore_eos": True}
    for stream in (False, True):
        r = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 200, r.text
        if not stream:
            choices = r.json()["choices"]
            assert len(choices) == 3 and {c["finish_reason"] for c in choices} <= {"stop", "length"}
            assert "stop" in {c["finish_reason"] for c in choices}
            assert not any("e" in c["text"] or "a" in c["text"] for c in choices), choices
    deadline = time.monotonic() + 10
    while (state := httpx.get(f"{server.url}/kv/state", timeout=10).json())["accounting"]["used_blocks"]:
        assert time.monotonic() < deadline, state["accounting"]
        time.sleep(0.1)
    assert state["integrity"] == "ok" and not state["requests"]


def test_thread_mode_and_a_bad_switch(tiny_llm_dir: Path) -> None:
    """PAGEDLLM_ENABLE_MULTIPROCESSING=0 keeps the engine loop a thread of the server; other values are refused."""
    env = {**os.environ, "PAGEDLLM_ENABLE_MULTIPROCESSING": "0"}
    srv = RemoteServer(tiny_llm_dir, env=env)
    try:
        assert not _core(srv)
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True},
                       timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        srv.stop()
    env["PAGEDLLM_ENABLE_MULTIPROCESSING"] = "yes"
    try:
        RemoteServer(tiny_llm_dir, env=env)
    except RuntimeError as e:
        assert "PAGEDLLM_ENABLE_MULTIPROCESSING must be 0 or 1, got 'yes'" in str(e)
    else:
        raise AssertionError("the server started with PAGEDLLM_ENABLE_MULTIPROCESSING=yes")
