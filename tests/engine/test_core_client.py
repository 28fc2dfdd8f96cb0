"""AsyncLLM, the API process's side of the engine core process, driven directly (no HTTP)."""
from __future__ import annotations

import asyncio
import glob
import os
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from pagedllm.config import EngineArgs
from pagedllm.engine.core_client import AsyncLLM
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
        AsyncLLM(EngineArgs(model=str(tiny_llm_dir), dtype="float32", max_model_len=10**9))
    assert e.value.param == "max_model_len" and time.monotonic() - started < 60
    assert not _cores() and _dirs() <= before


def test_cancelled_and_short_requests_leave_nothing_behind(tiny_llm_dir: Path) -> None:
    """A caller gone before the core accepted its request, requests that finish in their first step, an
    oversized integer: the core holds no request afterwards and nothing counts as waiting."""
    before = _dirs()
    engine = AsyncLLM(EngineArgs(model=str(tiny_llm_dir), dtype="float32", num_kv_blocks=64))
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
