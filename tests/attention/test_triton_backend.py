"""The triton backend's kernels under Triton's interpreter (CPU), in subprocesses: against the torch
backend on random steps (tests/attention/triton_check.py) and end to end in an LLM
(tests/attention/triton_llm_check.py). Compiled runs happen on a GPU (benchmarks/gpu_check.sh)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.attention.base import resolve_backend_name
from pagedllm.errors import ValidationError

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _interpret(*args: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "ALL OK" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@needs_triton
def test_kernels_match_the_torch_backend() -> None:
    """Block sizes 16/32, head sizes 64/128, MHA/GQA/MQA/group 3, float32/bf16/fp16, mixed prefill and
    decode batches, scattered block tables, strided q, split-K decode, sliding windows, soft-capped scores:
    float32 to 1e-5, half to 1e-2."""
    out = _interpret("tests.attention.triton_check")
    assert out.count("max diff") == 45 + 12


@needs_triton
def test_llm_greedy_tokens_match_the_torch_backend(tiny_llm_dir: Path) -> None:
    _interpret("tests.attention.triton_llm_check", str(tiny_llm_dir))


@needs_triton
def test_backend_choice_follows_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # makes triton available without a GPU
    assert resolve_backend_name("auto", "cuda") == "triton"
    for cpu_only in ("cpu", "torch"):
        with pytest.raises(ValidationError) as e:
            resolve_backend_name(cpu_only, "cuda")
        assert e.value.param == "attention_backend" and "triton" in str(e.value)


def test_auto_never_picks_triton_on_a_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend_name("auto") != "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    if not __import__("torch").cuda.is_available():
        with pytest.raises(ValidationError) as e:
            resolve_backend_name("triton")
        assert e.value.param == "attention_backend"
