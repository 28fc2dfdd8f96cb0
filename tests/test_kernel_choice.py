"""Which implementation runs is chosen once, when the model loads (layers/custom_op.py), never per call: the
layers' per-call code asks nothing of the platform, and a model keeps the implementation it was bound to.
``platform`` is the one answer to the CPU level and to CPU-or-CUDA."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm import platform
from pagedllm.errors import ValidationError
from pagedllm.layers import cpu_ops
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.custom_op import CustomOp, bind_ops
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.layers.sampler import Sampler
from tests.utils import kernel_levels, model_of

ROOT = Path(__file__).resolve().parent.parent
PER_CALL_CODE = ("layers", "models", "attention")
"""Folders whose per-call functions are checked."""
PER_CALL_NAMES = {"compute_logits", "_lookup", "_matmul", "_with_lora", "usable", "run", "rotate", "quant_linear",
                  "linear", "silu_and_mul", "silu_and_mul_linear", "_argmax", "_random_sample", "__call__"}
"""Functions that run every step (besides every ``forward*``)."""
PLATFORM_QUERIES = {"fused_ops", "kernels_for", "active", "active_level", "isa_level", "kernel_library", "switches",
                    "is_available", "use_level", "torch_ops_only", "cpu_info", "native_bf16", "resolve_device",
                    "resolve_backend_name"}
"""What decides which kernel or device runs: asked at load, never in a per-call function."""


def _per_call_functions() -> list[tuple[str, ast.FunctionDef]]:
    found = []
    for folder in PER_CALL_CODE:
        for path in sorted((ROOT / "pagedllm" / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef) and (node.name.startswith("forward") or
                                                          node.name in PER_CALL_NAMES):
                    found.append((f"{path.relative_to(ROOT)}:{node.lineno} {node.name}", node))
    return found


def _called_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def test_no_per_call_function_asks_the_platform() -> None:
    functions = _per_call_functions()
    assert len(functions) > 20, "the check found the layers' forward methods"
    offenders = [f"{where} calls {_called_name(node)}()" for where, fn in functions for node in ast.walk(fn)
                 if isinstance(node, ast.Call) and _called_name(node) in PLATFORM_QUERIES]
    device_checks = [f"{where} reads .{node.attr}" for where, fn in functions for node in ast.walk(fn)
                     if isinstance(node, ast.Attribute) and node.attr in ("is_cuda", "is_cpu")]
    assert not offenders + device_checks, offenders + device_checks


def test_every_custom_op_is_bound_where_it_is_built(kernels) -> None:
    ops = [RMSNorm(64, 1e-5, torch.bfloat16), SiluAndMul(), RotaryEmbedding(16, 64, 10000.0, None, torch.bfloat16)]
    for op in ops:
        assert "forward" in vars(op), "the implementation is the instance's forward itself: no dispatch per call"
        assert op.implementation == "forward_cpu" and op.kernels is kernels
    assert Sampler().kernels is kernels
    narrow = RMSNorm(4, 1e-5, torch.float32)  # rows narrower than a vector: not worth a kernel call
    assert narrow.implementation == "forward_native" and narrow.kernels is None
    with cpu_ops.torch_ops_only():  # A/B runs: what is built inside takes the torch expressions
        assert SiluAndMul().implementation == "forward_native" and Sampler().kernels is None
    for op in bind_ops(torch.nn.ModuleList(ops), "cuda"):  # what the worker does once the model is on a GPU
        assert op.implementation == "forward_cuda" and op.kernels is None
    assert Sampler("cuda").kernels is None


def test_portable_level_binds_the_torch_expressions() -> None:
    with cpu_ops.use_level("portable"):
        ops = [RMSNorm(64, 1e-5, torch.float32), SiluAndMul(), RotaryEmbedding(16, 64, 10000.0, None, torch.float32)]
    assert all(op.implementation == "forward_native" and op.kernels is None for op in ops)
    x = torch.randn(3, 64)
    assert torch.equal(ops[0](x), ops[0].forward_native(x)) and torch.equal(ops[1](x), ops[1].forward_native(x))


def test_a_bound_op_keeps_its_kernels_and_asks_nothing_per_call(kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    norm, act = RMSNorm(64, 1e-5, torch.float32), SiluAndMul()
    x = torch.randn(5, 64)
    with cpu_ops.use_level("portable"):  # a later level does not reach a bound op
        _forbid_platform_queries(monkeypatch)
        assert norm.kernels is kernels and act.kernels is kernels
        assert torch.equal(norm(x), norm.forward_cpu(x)) and torch.equal(act(x), act.forward_cpu(x))


def _forbid_platform_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a platform or kernel-level query during a step")

    for name in ("kernels_for", "fused_ops", "active", "kernels", "active_level"):
        monkeypatch.setattr(cpu_ops, name, forbidden)
    for name in ("active_level", "isa_level", "kernel_library", "switches", "resolve_device", "default_dtype"):
        monkeypatch.setattr(platform, name, forbidden)
    monkeypatch.setattr(torch.cuda, "is_available", forbidden)


def test_a_loaded_model_steps_without_asking_the_platform(tiny_llm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(tiny_llm_dir), dtype="float32", num_kv_blocks=32)
    model = model_of(llm)
    ops = [m for m in model.modules() if isinstance(m, CustomOp)]
    want = "forward_cpu" if cpu_ops.active() is not None else "forward_native"
    assert ops and {op.implementation for op in ops} == {want}
    # a linear layer kept quantized or packed at load has its matmul bound then; a plain one runs F.linear
    linears = [m for m in model.modules() if hasattr(m, "packed_weight")]
    assert linears and all(("_matmul" in vars(m)) == (m.packed_weight is not None or m.quant is not None)
                           for m in linears)
    params = SamplingParams(max_tokens=3, temperature=0.8, seed=1)
    llm.generate(["a b c", "d"], params, use_tqdm=False)  # the first step builds the compiled stack where it runs
    outs = []
    with monkeypatch.context() as patched:
        _forbid_platform_queries(patched)
        outs.append(llm.generate(["a b c", "d"], params, use_tqdm=False))
        model.model._stack = None  # the layers one by one
        outs.append(llm.generate(["a b c", "d"], params, use_tqdm=False))
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs[0]] == [o.outputs[0].token_ids for o in outs[1]]


@pytest.mark.parametrize("level", ["portable", *kernel_levels()[:1]])
def test_forced_isa_binds_that_level(level: str) -> None:
    """PAGEDLLM_ISA in a fresh process: its layers bind that level's kernels (portable: the torch expressions)."""
    code = ("import torch, pagedllm; from pagedllm.layers.norm import RMSNorm; n = RMSNorm(64, 1e-5, torch.float32); "
            "print(n.implementation, n.kernels.level if n.kernels else None)")
    env = {**os.environ, "PAGEDLLM_ISA": level}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    want = "forward_native None" if level == "portable" else f"forward_cpu {level}"
    assert done.stdout.split("\n")[-2] == want, done.stdout


def test_resolve_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert platform.resolve_device("auto") == "cpu" and platform.resolve_device("cpu") == "cpu"
    with pytest.raises(ValidationError, match="torch sees no CUDA device") as err:
        platform.resolve_device("cuda")
    assert err.value.param == "device"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert platform.resolve_device("auto") == "cuda" and platform.resolve_device("cuda") == "cuda"


def test_one_name_one_thing() -> None:
    """``platform.kernel_library``: the loaded ctypes library; ``cpu_ops.kernels``: the typed wrappers over it."""
    assert not hasattr(platform, "kernels")
    library, wrapped = platform.kernel_library(), cpu_ops.kernels()
    assert (library is None) == (wrapped is None)
    if library is not None:
        assert isinstance(library, platform.KernelLibrary) and isinstance(wrapped, cpu_ops.CpuKernels)
        assert wrapped.level == library.level
    assert cpu_ops.use_level is platform.use_level and cpu_ops.active_level is platform.active_level
