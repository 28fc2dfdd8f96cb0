"""A real `pagedllm serve` process on a free 127.0.0.1 port, serving the tiny model."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`pagedllm serve MODEL --port P ...` in a subprocess; ready once /health answers 200."""

    def __init__(self, model: Path, *args: str, env: dict | None = None, log: Path | None = None,
                 preexec_fn: Callable[[], None] | None = None) -> None:
        """``log``: a file for the server's output (a long run would fill a pipe nobody reads); ``preexec_fn``:
        run in the child before the server starts (e.g. to lower its resource limits)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(model), "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", "float32", "--uvicorn-log-level", "warning", *args]
        out = subprocess.PIPE if log is None else open(log, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=preexec_fn)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                text = self.proc.stdout.read() if log is None else Path(log).read_text()
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{text}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become healthy within 120 s")

    def metric(self, name: str) -> float:
        """The value of one (single-series) Prometheus metric."""
        for line in httpx.get(f"{self.url}/metrics", timeout=5).text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="session")
def server(tiny_llm_dir: Path) -> Iterator[RemoteServer]:
    srv = RemoteServer(tiny_llm_dir, "--served-model-name", "tiny")
    yield srv
    srv.stop()
