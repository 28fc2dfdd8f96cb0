"""Instruction-set levels from CPU flags, PAGEDLLM_ISA, the start-up line and torch's caps."""
from __future__ import annotations

import pytest
import torch  # noqa: F401  (loaded before the kernels: one OpenMP runtime)

from pagedllm import platform
from pagedllm.errors import ValidationError
from pagedllm.platform.cpu import CpuInfo, cap_torch_to_forced_level, check_level

ZEN3 = frozenset("fpu sse sse2 avx avx2 fma f16c bmi2".split())
SKYLAKE_X = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
ZEN4 = SKYLAKE_X | {"avx512_bf16", "avx512_vnni"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_bf16", "amx_tile", "amx_int8"}


@pytest.mark.parametrize("machine, flags, level", [
    ("x86_64", ZEN3, "avx2"), ("x86_64", SKYLAKE_X, "avx512"), ("x86_64", ZEN4, "avx512_bf16"),
    ("x86_64", SAPPHIRE_RAPIDS, "amx"), ("x86_64", frozenset({"avx", "sse4_2"}), "portable"),
    ("x86_64", frozenset({"avx2", "fma"}), "portable"),  # no F16C: the avx2 kernels need it
    ("aarch64", frozenset({"asimd", "bf16", "sve"}), "portable"), ("arm64", frozenset(), "portable"),
])
def test_native_level_from_flags(machine: str, flags: frozenset[str], level: str) -> None:
    assert CpuInfo(machine, "cpu", flags).native_level() == level


def test_features_name_what_matters() -> None:
    assert CpuInfo("x86_64", "c", ZEN3).features() == "AVX2+FMA (no AVX-512)"
    assert CpuInfo("x86_64", "c", SKYLAKE_X).features() == "AVX-512 (no BF16)"
    assert CpuInfo("x86_64", "c", SAPPHIRE_RAPIDS).features() == "AVX-512+BF16+VNNI+AMX-BF16"
    assert CpuInfo("aarch64", "c", frozenset({"asimd", "bf16", "sve"})).features() == "NEON+BF16+SVE"


def test_a_forced_level_above_the_cpu_is_an_error_naming_the_variable() -> None:
    assert check_level("avx2", "avx512_bf16") == "avx2"
    with pytest.raises(ValidationError, match="PAGEDLLM_ISA=avx512 is above what this CPU runs") as e:
        check_level("avx512", "avx2")
    assert e.value.param == "PAGEDLLM_ISA"
    with pytest.raises(ValidationError, match="PAGEDLLM_ISA"):
        check_level("sse9", "avx2")


def test_forcing_caps_torch_only_below_the_native_level(monkeypatch: pytest.MonkeyPatch) -> None:
    native = platform.cpu_info().native_level()
    env = {"PAGEDLLM_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "mine"}
    applied = cap_torch_to_forced_level(env)
    if native in ("avx2", "portable"):
        assert applied == {}
    else:
        assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
        assert env["ONEDNN_MAX_CPU_ISA"] == "mine" and "ONEDNN_MAX_CPU_ISA" not in applied  # never overridden
    assert cap_torch_to_forced_level({}) == {}


def test_start_up_line_names_cpu_kernels_and_dtype() -> None:
    line = platform.describe("bfloat16")
    cpu = platform.cpu_info()
    assert line.startswith(f"CPU: {cpu.model_name}, {cpu.features()}") and "kernels " in line and "dtype " in line
    lib = platform.kernel_library()
    if lib is not None and not platform.native_bf16(lib.level):
        assert "bfloat16 storage / float32 compute" in line
    assert platform.describe("float32").endswith("dtype float32")
