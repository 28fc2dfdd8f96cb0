"""`pagedllm serve` starts its engine core process before its own imports (engine/local_core.py): the server
runs on that very core, and every start that does not reach the engine (a refused flag, the help, the thread
mode) leaves no core process and no socket folder behind."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from pagedllm.engine.local_core import CORE_MODULE, SOCKET_DIR_PREFIX
from tests.utils import free_port


def _cores(pid: int) -> list[int]:
    """The engine core processes that ``pid`` started."""
    found = []
    for child in psutil.Process(pid).children():
        try:
            if CORE_MODULE in child.cmdline():
                found.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return found


def _watch(cmd: list[str], env: dict[str, str], until: float = 120.0) -> tuple[subprocess.CompletedProcess, list[int]]:
    """Run ``cmd`` to its exit, noting every core process it had on the way (polled every 20 ms)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[int] = []
    deadline = time.monotonic() + until
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            seen += [pid for pid in _cores(proc.pid) if pid not in seen]
        except psutil.NoSuchProcess:
            break
        time.sleep(0.02)
    out, _ = proc.communicate(timeout=30)
    return subprocess.CompletedProcess(cmd, proc.returncode, out), seen


def _serve(model: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(model), "--dtype", "float32",
            "--host", "127.0.0.1", "--port", str(free_port()), *args]


def _assert_nothing_left(cores: list[int], tmp: Path) -> None:
    assert not [pid for pid in cores if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"], cores
    assert not list(tmp.glob(f"{SOCKET_DIR_PREFIX}*")), list(tmp.iterdir())


def test_the_server_runs_on_the_core_it_started_first(tiny_llm_dir: Path, tmp_path: Path) -> None:
    """The core seen while the front still imports (before /health) is the one that serves, and the only one."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    cmd = _serve(tiny_llm_dir, "--uvicorn-log-level", "warning")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
    try:
        early: list[int] = []
        healthy = False
        deadline = time.monotonic() + 120
        while not healthy and time.monotonic() < deadline and proc.poll() is None:
            early = early or _cores(proc.pid)
            try:
                healthy = httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.02)
        assert healthy, proc.stdout.read() if proc.poll() is not None else "not healthy"
        assert early and _cores(proc.pid) == early, (early, _cores(proc.pid))
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=30)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3, reply.text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    _assert_nothing_left(early, tmp_path)


def test_a_start_that_does_not_reach_the_engine_leaves_nothing(tiny_llm_dir: Path, tmp_path: Path) -> None:
    """A flag refused after the imports: the early core existed and is gone with the socket folder; --help and
    the thread mode start none."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    refused, cores = _watch(_serve(tiny_llm_dir, "--api-server-count", "2"), env)
    assert refused.returncode == 2 and "--api-server-count 2" in refused.stdout, refused.stdout
    assert cores, "the core was not started before the server's imports"
    _assert_nothing_left(cores, tmp_path)
    helped, cores = _watch([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--help"], env)
    assert helped.returncode == 0 and "--api-server-count" in helped.stdout and cores == [], cores
    threaded, cores = _watch(_serve(tiny_llm_dir, "--api-server-count", "2"),
                             {**env, "PAGEDLLM_ENABLE_MULTIPROCESSING": "0"})
    assert threaded.returncode == 2 and cores == [], (threaded.stdout, cores)
    _assert_nothing_left(cores, tmp_path)
