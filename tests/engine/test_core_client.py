"""AsyncLLM with its engine core in a child process (MPClient), driven directly (no HTTP)."""
from __future__ import annotations

import asyncio
import glob
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import zmq

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.messages import PROTOCOL_VERSION, StartCore, StartupError
from pagedllm.engine.serial import decode, encode
from pagedllm.errors import ValidationError
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


def _cores() -> list[psutil.Process]:
    return [p for p in psutil.Process(os.getpid()).children() if "pagedllm.engine.core_proc" in " ".join(p.cmdline())]


def _dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "pagedllm-core-*")))


def test_a_core_that_cannot_start_raises_its_error_and_leaves_nothing(tiny_llm_dir: Path) -> None:
    before = _dirs()
    started = time.monotonic()
    with pytest.raises(ValidationError) as e:
        AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_llm_dir), dtype="float32", max_model_len=10**9),
                                  multiprocess=True)
    assert e.value.param == "max_model_len" and time.monotonic() - started < 60
    assert not _cores() and _dirs() <= before


def test_cancelled_and_short_requests_leave_nothing_behind(tiny_llm_dir: Path) -> None:
    """A caller gone before the core accepted its request, requests that finish in their first step, an
    oversized integer: the core holds no request afterwards and nothing counts as waiting."""
    before = _dirs()
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_llm_dir), dtype="float32", num_kv_blocks=64),
                                       multiprocess=True)
    core = _cores()
    assert len(core) == 1

    async def run() -> None:
        engine.start()
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        waiting = asyncio.create_task(engine.add_request("gone", "never read", params))
        await asyncio.sleep(0)  # sent, not yet accepted
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        one = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
        streams = [await engine.add_request(f"short-{i}", f"prompt {i}", one) for i in range(6)]
        for stream in streams:
            outputs = [out async for out in stream]
            assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 1
        with pytest.raises(ValidationError) as e:
            await engine.add_request("big", "hi", SamplingParams(seed=2**70))
        assert e.value.param == "seed"
        deadline = time.monotonic() + 10
        while (state := await engine.kv_state())["requests"] or engine.get_stats().num_running:
            assert time.monotonic() < deadline, state["requests"]
            await asyncio.sleep(0.05)
        assert state["accounting"]["used_blocks"] == 0 and engine.num_waiting == 0
        await engine.shutdown()

    try:
        asyncio.run(run())
    finally:
        engine.close()
    assert not core[0].is_running() and _dirs() <= before


def test_a_core_of_another_protocol_version_refuses_to_start(tmp_path: Path) -> None:
    """The handshake: StartCore carries the front's PROTOCOL_VERSION; a core of another version answers a
    StartupError naming both and exits, before it loads anything."""
    ctx = zmq.Context()
    commands, results = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    commands.bind(f"ipc://{tmp_path}/commands")
    results.bind(f"ipc://{tmp_path}/results")
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.engine.core_proc", f"ipc://{tmp_path}/commands",
                             f"ipc://{tmp_path}/results"])
    try:
        commands.send(encode(StartCore(version=PROTOCOL_VERSION + 1, engine_args=EngineArgs(model="not-loaded"))))
        assert results.poll(60_000), "no answer from the core"
        answer = decode(results.recv())
        assert isinstance(answer, StartupError), answer
        message = answer.error.message
        assert f"version {PROTOCOL_VERSION}" in message and str(PROTOCOL_VERSION + 1) in message
        assert proc.wait(timeout=30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
        commands.close(0)
        results.close(0)
        ctx.term()


def test_a_core_whose_front_died_while_it_started_exits(tmp_path: Path) -> None:
    """A front SIGKILLed while its core was still importing torch dies before the core asks to die with it: the
    core sees its parent is no longer the pid it was given and exits, rather than wait forever as an orphan."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    address = f"ipc://{tmp_path}/x"
    core = subprocess.run([sys.executable, "-m", "pagedllm.engine.core_proc", address, address + "y",
                           "--parent-pid", str(gone.pid)], timeout=120, capture_output=True)
    assert core.returncode == 1, core.stderr[-2000:]
