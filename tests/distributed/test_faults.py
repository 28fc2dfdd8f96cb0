"""A worker that dies, raises or stops fails the engine at once, naming its rank; nothing is left behind.

Servers run as real `pagedllm serve --tensor-parallel-size 2` processes on 127.0.0.1 (mp and ray);
every load here is a handful of bounded requests with timeouts.
"""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.executor.base import WorkerError
from tests.distributed.utils import BACKENDS, shm_segments
from tests.utils import RemoteServer


def _workers(server_pid: int, backend: str) -> list[psutil.Process]:
    """The server's worker processes: spawned children (mp) or Ray's RayWorker actors."""
    found = []
    for p in psutil.Process(server_pid).children(recursive=True):
        try:
            cmdline = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if (backend == "mp" and "multiprocessing.spawn" in cmdline) or (backend == "ray" and "RayWorker" in cmdline):
            found.append(p)
    return found


def _stream_until_error(url: str, i: int, errors: list[float], started: threading.Event) -> None:
    body = {"prompt": f"fault {i}", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                started.set()
                if '"error"' in line:
                    break
    except httpx.HTTPError:
        pass
    errors.append(time.monotonic())


@dataclasses.dataclass
class Killed:
    """What a server did after one of its processes was killed under load."""

    code: int
    output: str
    health: list[int]
    """/health's answers, every 0.1 s until the server exited."""
    errors: list[float]
    """When each of the 4 streams ended (in an error, or cut)."""
    killed_at: float
    refused: list[httpx.Response]
    """The answer to a new request sent once /health said 503 (if it did while the server was up)."""


def kill_under_load(srv: RemoteServer, victim: psutil.Process) -> Killed:
    """SIGKILL ``victim`` while 4 long streams run; watch /health (and try a new request) until the server exits."""
    errors: list[float] = []
    started = threading.Event()
    clients = [threading.Thread(target=_stream_until_error, args=(srv.url, i, errors, started), daemon=True)
               for i in range(4)]
    for t in clients:
        t.start()
    assert started.wait(30)
    killed_at = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    health: list[int] = []
    refused: list[httpx.Response] = []
    while srv.proc.poll() is None and time.monotonic() - killed_at < 15:
        try:
            health.append(httpx.get(f"{srv.url}/health", timeout=1).status_code)
            if health[-1] == 503 and not refused:  # a new request while the server winds down
                refused.append(httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                          timeout=5))
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    code = srv.proc.wait(timeout=15)
    for t in clients:
        t.join(timeout=10)
    return Killed(code, srv.proc.stdout.read(), health, errors, killed_at, refused)


def _assert_gone(procs: list[psutil.Process]) -> None:
    deadline = time.monotonic() + 10
    left = procs
    while left and time.monotonic() < deadline:
        left = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    assert not left, [(p.pid, p.name()) for p in left]


@pytest.mark.parametrize(("backend", "layout"), [*((b, "tensor") for b in BACKENDS), ("mp", "pipeline")])
def test_killed_worker_fails_the_server(tiny_llm_dir: Path, backend: str, layout: str) -> None:
    """Two ranks, or two pipeline stages (the first one killed: the last waits on it for hidden states)."""
    shm_before = shm_segments()
    srv = RemoteServer(tiny_llm_dir, f"--{layout}-parallel-size", "2", "--distributed-executor-backend", backend)
    try:
        workers = sorted(_workers(srv.proc.pid, backend), key=lambda p: p.create_time())
        assert len(workers) == 2, workers
        everything = psutil.Process(srv.proc.pid).children(recursive=True)
        target = workers[0] if layout == "pipeline" else workers[-1]
        victim = target.pid
        dead = kill_under_load(srv, target)
        output, errors, killed_at = dead.output, dead.errors, dead.killed_at
        assert dead.code != 0, output
        assert 503 in dead.health, (dead.health, output)
        assert len(errors) == 4 and max(errors) - killed_at < 10, (errors, killed_at)
        rank = re.search(rf"rank (\d)/2 \(pid {victim}\)", output).group(1)  # each rank logs its pid
        assert re.search(rf"worker rank {rank} .*(died|killed)", output), output[-3000:]
        _assert_gone(everything)
        assert shm_segments() <= shm_before
    finally:
        srv.stop()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigterm_exits_0_and_leaves_nothing(tiny_llm_dir: Path, backend: str) -> None:
    shm_before = shm_segments()
    srv = RemoteServer(tiny_llm_dir, "--tensor-parallel-size", "2", "--distributed-executor-backend", backend)
    try:
        everything = psutil.Process(srv.proc.pid).children(recursive=True)
        assert len(_workers(srv.proc.pid, backend)) == 2
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=20) == 0
        _assert_gone(everything)
        assert shm_segments() <= shm_before
    finally:
        srv.stop()


def test_stopped_worker_and_raising_worker_name_their_rank(tp_llm: Callable[..., LLM], tiny_llm_dir: Path) -> None:
    llm = tp_llm(tiny_llm_dir, tensor_parallel_size=2)
    executor = llm.llm_engine.engine_core.core.executor
    rank1 = executor.workers[1].process.pid
    os.kill(rank1, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(WorkerError, match="rank 1") as e:
            llm.generate(["stopped"], SamplingParams(max_tokens=4), use_tqdm=False)
        assert e.value.rank == 1 and time.monotonic() - started < 10
    finally:
        with pytest.raises(ProcessLookupError):  # the executor killed it
            for _ in range(50):
                os.kill(rank1, signal.SIGCONT)
                time.sleep(0.1)
    with pytest.raises(WorkerError, match="rank 1"):  # the engine stays failed
        llm.generate(["again"], SamplingParams(max_tokens=4), use_tqdm=False)

    other = tp_llm(tiny_llm_dir, tensor_parallel_size=2)
    with pytest.raises(WorkerError, match="rank [01] failed") as e:  # both ranks raise; the first report wins
        other.llm_engine.engine_core.core.executor.collective_rpc("no_such_method")
    assert e.value.rank in (0, 1) and "AttributeError" in str(e.value)
