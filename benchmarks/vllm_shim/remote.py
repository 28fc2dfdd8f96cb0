"""What vLLM's server tests import from its ``tests/utils.py``, ours: ``RemoteOpenAIServer`` starts
``pagedllm serve`` on 127.0.0.1 with the translated flags and a local stand-in model (``translate.py``); a test
whose flags, model or environment we lack is skipped naming them. Installed as ``tests.utils`` by ``plugin.py``."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from .fake_vllm import _get_open_port as get_open_port
from .translate import TAG_SHIM, TAG_START, Refused, translate

#: The unpacked source package's root (tests/, examples/): set by plugin.py.
VLLM_PATH = Path(os.environ.get("VLLM_SHIM_ROOT", "."))
ROCM_EXTRA_ARGS: list[str] = []
#: Where each server's output goes (one file per start): set by plugin.py.
LOG_DIR = Path(os.environ.get("VLLM_SHIM_LOGS", "."))
SERVER_SITE = Path(__file__).resolve().parent / "server_site"
"""Its sitecustomize.py: in a server, ``tests.utils`` is this module (a test module named by --worker-extension-cls
imports it)."""
#: Ports of the servers started and alive: plugin.py counts a request to one of them as reaching the server.
LIVE_PORTS: set[int] = set()
#: The same for servers on a Unix socket (--uds): the socket file's name, their URLs' host.
LIVE_UDS_HOSTS: set[str] = set()
#: Every start: (test file, model, our argv, seconds to start or None when it failed).
STARTS: list[dict[str, Any]] = []
#: The test file being run (set by plugin.py).
CURRENT: dict[str, str] = {"file": ""}


class RemoteOpenAIServer:
    """``pagedllm serve`` in place of ``vllm serve``: same constructor and client helpers as vLLM's."""

    DUMMY_API_KEY = "token-abc123"
    COMMAND = ["serve"]
    """The pagedllm command that stands for vLLM's."""

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict: dict[str, str] | None = None,
                 seed: int | None = 0, auto_port: bool = True, max_wait_seconds: float | None = None,
                 override_hf_configs: dict[str, Any] | None = None) -> None:
        """Translates the command line (skipping the test on what we lack), starts the server, waits for /health."""
        args = list(vllm_serve_args)
        if override_hf_configs is not None:
            args += ["--hf-overrides", json.dumps(override_hf_configs)]
        if seed is not None and "--seed" not in args:
            args += ["--seed", str(seed)]
        try:
            command = translate(model, args, env_dict)
        except Refused as e:
            pytest.skip(e.reason)
        # --uds passes through: the server then listens on that socket alone (its --host/--port unused)
        self.uds = command.args[command.args.index("--uds") + 1] if "--uds" in command.args else None
        self.host = "127.0.0.1"
        self.port = get_open_port()
        self.show_hidden_metrics = False
        argv = [sys.executable, "-m", "pagedllm.entrypoints.cli", *self.COMMAND, command.model, "--host", self.host,
                "--port", str(self.port), "--uvicorn-log-level", "warning", *command.args]
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"server-{len(STARTS):03d}.log"
        record = {"file": CURRENT["file"], "model": model, "argv": argv[3:], "dropped": command.dropped,
                  "log": self.log_path.name, "start_s": None}
        STARTS.append(record)
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_SHIM")}
        env.update(command.env)
        # the shim's stand-in for vLLM's tests/utils.py, should the server import a test module (server_site/)
        env["PYTHONPATH"] = os.pathsep.join([str(SERVER_SITE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        with open(self.log_path, "w") as log:
            log.write(" ".join(argv) + "\n")
            log.flush()
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        start = time.monotonic()
        deadline = start + min(max_wait_seconds or 240, 240)
        while True:
            code = self.proc.poll()
            if code is not None:
                tail = self.log_path.read_text().strip().splitlines()[-3:]
                pytest.skip(f"{TAG_START} pagedllm serve exited with {code}: {' | '.join(tail)[-300:]}")
            if self._healthy():
                break
            if time.monotonic() > deadline:
                self._shutdown()
                raise RuntimeError(f"pagedllm serve did not become healthy in time (log {self.log_path})")
            time.sleep(0.3)
        record["start_s"] = round(time.monotonic() - start, 1)
        LIVE_PORTS.add(self.port)
        if self.uds is not None:
            LIVE_UDS_HOSTS.add(self.uds.split("/")[-1].lower())

    def _healthy(self) -> bool:
        """Whether /health answers 200 (over the Unix socket with --uds)."""
        if self.uds is not None:
            try:
                with httpx.Client(transport=httpx.HTTPTransport(uds=self.uds), timeout=2) as client:
                    return client.get(self.url_for("health")).status_code == 200
            except httpx.HTTPError:
                return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def __enter__(self) -> RemoteOpenAIServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._shutdown()

    def _shutdown(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 15 s."""
        LIVE_PORTS.discard(self.port)
        if self.uds is not None:
            LIVE_UDS_HOSTS.discard(self.uds.split("/")[-1].lower())
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass

    @property
    def url_root(self) -> str:
        """http://127.0.0.1:PORT (with --uds, as vLLM's: http://<the socket file's name>)"""
        if self.uds is not None:
            return f"http://{self.uds.split('/')[-1]}"
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        """The URL of a path under the server's root."""
        path = "/".join(part.strip("/") for part in parts if part)
        return f"{self.url_root}/{path}"

    def get_client(self, **kwargs: Any) -> openai.OpenAI:
        """An OpenAI client of /v1 (no retries)."""
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        """An async OpenAI client of /v1 (no retries)."""
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0,
                                  **kwargs)

    def get_client_anthropic(self, **kwargs: Any) -> anthropic.Anthropic:
        """An Anthropic client of the server's root (no retries)."""
        kwargs.setdefault("timeout", 600)
        return anthropic.Anthropic(base_url=self.url_for(), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client_anthropic(self, **kwargs: Any) -> anthropic.AsyncAnthropic:
        """An async Anthropic client of the server's root (no retries)."""
        kwargs.setdefault("timeout", 600)
        return anthropic.AsyncAnthropic(base_url=self.url_for(), api_key=self.DUMMY_API_KEY, max_retries=0,
                                        **kwargs)


class RemoteOpenAIServerCustom(RemoteOpenAIServer):
    """vLLM's server launched in a custom child process: skipped (it runs vLLM's own code in the child)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pytest.skip(f"{TAG_SHIM} RemoteOpenAIServerCustom runs vLLM's code in a child process")


class RemoteLaunchRenderServer(RemoteOpenAIServer):
    """``vllm launch render`` (a GPU-less render-only server): ``pagedllm launch render``."""

    COMMAND = ["launch", "render"]


def _skip_mark(why: str) -> pytest.MarkDecorator:
    return pytest.mark.skip(reason=f"[gpu] {why}")


def large_gpu_mark(min_gb: int) -> pytest.MarkDecorator:
    """A GPU of min_gb: skipped here."""
    return _skip_mark(f"needs a GPU with {min_gb} GB")


def multi_gpu_test(*, num_gpus: int) -> Any:
    """Several GPUs: skipped here."""
    return _skip_mark(f"needs {num_gpus} GPUs")


def multi_gpu_only(*, num_gpus: int = 2) -> Any:
    """Several GPUs: skipped here."""
    return _skip_mark(f"needs {num_gpus} GPUs")


def requires_fp8(*args: Any, **kwargs: Any) -> Any:
    """FP8 hardware: skipped here."""
    return _skip_mark("needs FP8 hardware")


def create_new_process_for_each_test(*args: Any, **kwargs: Any) -> Any:
    """vLLM forks per test for GPU state; nothing to isolate here: the test as it is."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda f: f
