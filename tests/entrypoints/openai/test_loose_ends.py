"""Issue 43's loose ends against a real `pagedllm serve`: a SIGKILLed server's socket folder is swept by the
next start, a flag is a strict JSON boolean ("yes" is a 400 naming it), and /v1/models shows no filesystem
path (while a request naming the path as given is still served). The dead engine's 503 is checked in
test_core_process.py, NaN/Inf LoRA weights in tests/lora/test_lora_server.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.utils import RemoteServer, free_port


def _socket_dirs(root: Path) -> list[Path]:
    return sorted(root.glob("pagedllm-core-*"))


def test_the_socket_folder_of_a_sigkilled_server_is_swept(tiny_llm_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(tiny_llm_dir), "--port", str(free_port()),
           "--dtype", "float32"]
    killed = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not _socket_dirs(tmp_path):  # the core is starting: its sockets are in the folder
            assert killed.poll() is None and time.monotonic() < deadline, "no socket folder appeared"
            time.sleep(0.02)
        children = psutil.Process(killed.pid).children(recursive=True)
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
    psutil.wait_procs(children, timeout=10)  # the core dies with it (PR_SET_PDEATHSIG)
    left = _socket_dirs(tmp_path)
    assert left, "the folder went before the sweep: nothing was left to test"  # what a SIGKILL leaves
    srv = RemoteServer(tiny_llm_dir, "--served-model-name", "tiny", env=env)
    try:
        assert _socket_dirs(tmp_path) == [], _socket_dirs(tmp_path)  # the stale one swept, its own removed
    finally:
        srv.stop()


@pytest.mark.parametrize("field, value", [("stream", "yes"), ("stream", "true"), ("echo", 1),
                                          ("ignore_eos", "on")])
def test_a_flag_is_a_json_boolean(server: RemoteServer, field: str, value: object) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: value}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream", r.text
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: True}, timeout=30)
    assert r.status_code == 200, r.text


def test_models_show_no_filesystem_path(tiny_llm_dir: Path) -> None:
    srv = RemoteServer(tiny_llm_dir)  # no --served-model-name: the name comes from the model argument
    try:
        cards = httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"]
        assert [(c["id"], c["root"]) for c in cards] == [(tiny_llm_dir.name, tiny_llm_dir.name)], cards
        for model in (tiny_llm_dir.name, str(tiny_llm_dir)):  # the listed name, and the path as clients sent it
            r = httpx.post(f"{srv.url}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2},
                           timeout=30)
            assert r.status_code == 200 and r.json()["model"] == tiny_llm_dir.name, r.text
        assert str(tiny_llm_dir.parent) not in httpx.get(f"{srv.url}/v1/models", timeout=10).text
    finally:
        srv.stop()


def test_the_sweep_takes_only_dead_pids_of_its_own_namespace(tmp_path: Path) -> None:
    """A folder is stale only when its pid, in the namespace that made it, no longer runs: another container's
    folders (same user, shared temp folder), unmarked ones and a running front's stay."""
    from pagedllm.engine.local_core import NAMESPACE_FILE, SOCKET_DIR_PREFIX, pid_namespace, sweep_socket_dirs
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ns = pid_namespace()
    folders = {"dead": (dead.pid, ns), "alive": (os.getpid(), ns), "other": (dead.pid, ns + 1),
               "unmarked": (dead.pid, None)}
    for name, (pid, namespace) in folders.items():
        folder = tmp_path / f"{SOCKET_DIR_PREFIX}{pid}-{name}"
        folder.mkdir()
        if namespace is not None:
            (folder / NAMESPACE_FILE).write_text(str(namespace))
    assert sweep_socket_dirs(str(tmp_path)) == [str(tmp_path / f"{SOCKET_DIR_PREFIX}{dead.pid}-dead")]
    assert sorted(p.name.split("-")[-1] for p in tmp_path.iterdir()) == ["alive", "other", "unmarked"]
