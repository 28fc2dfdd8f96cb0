"""What CPU this is, and the instruction-set level its kernels run at.

Levels, lowest first: ``portable`` (torch's own ops only: any CPU torch runs on, aarch64
included), ``avx2`` (AVX2 + FMA + F16C), ``avx512`` (AVX-512 F/BW/VL/DQ), ``avx512_bf16``
(+ AVX512-BF16 and VNNI dot products), ``amx`` (+ AMX-BF16 tiles, used through oneDNN). A CPU runs its
own level and every level below it; ``PAGEDLLM_ISA`` forces a lower one (a higher one is an error).
"""
from __future__ import annotations

import functools
import os
import platform as _stdlib_platform
from dataclasses import dataclass

from pagedllm import envs
from pagedllm.errors import ValidationError

LEVELS = ("portable", "avx2", "avx512", "avx512_bf16", "amx")
"""Instruction-set levels, lowest first."""

ISA_ENV = envs.ISA.name

_X86 = ("x86_64", "amd64", "i686", "i386")
_LEVEL_FLAGS = {  # /proc/cpuinfo flags each level needs on top of the level below
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "avx512_bf16": {"avx512_bf16", "avx512_vnni"},  # every CPU with BF16 dot products has VNNI's int8 ones
    "amx": {"amx_bf16", "amx_tile"},
}


@dataclass(frozen=True)
class CpuInfo:
    """The facts read once from the OS: architecture, model name, feature flags."""

    machine: str
    """``platform.machine()``: x86_64, aarch64, arm64, ..."""
    model_name: str
    flags: frozenset[str]
    """/proc/cpuinfo ``flags`` (x86) or ``Features`` (ARM); empty where the OS has no such file."""

    @property
    def is_x86(self) -> bool:
        return self.machine.lower() in _X86

    def native_level(self) -> str:
        """The highest level this CPU runs."""
        if not self.is_x86:
            return "portable"
        level = "portable"
        for name in LEVELS[1:]:
            if not _LEVEL_FLAGS[name] <= self.flags:
                break
            level = name
        return level

    def features(self) -> str:
        """The instruction sets that matter here, for the start-up line."""
        f = self.flags
        if self.is_x86:
            if "avx2" not in f:
                return "no AVX2"
            if "avx512f" not in f:
                return "AVX2+FMA (no AVX-512)"
            parts = ["AVX-512"] + [name for name, flag in (("BF16", "avx512_bf16"), ("VNNI", "avx512_vnni"))
                                   if flag in f]
            parts += ["AMX-BF16"] if {"amx_bf16", "amx_tile"} <= f else []
            return "+".join(parts) + ("" if "avx512_bf16" in f else " (no BF16)")
        if self.machine.lower() in ("aarch64", "arm64"):
            names = [name for name, flag in (("NEON", "asimd"), ("BF16", "bf16"), ("SVE", "sve")) if flag in f]
            return "+".join(names) or "ARM"
        return self.machine


def _read_cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "cpu model") and not model:
                    model = value.strip()
                elif key in ("flags", "features") and not flags:
                    flags = frozenset(value.split())
    except OSError:  # not Linux: no flags, the portable level
        pass
    return model, flags


@functools.lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    """This machine's CPU, read once."""
    model, flags = _read_cpuinfo()
    return CpuInfo(_stdlib_platform.machine(), model or _stdlib_platform.processor() or "unknown CPU", flags)


def check_level(level: str, native: str) -> str:
    """``level`` if this CPU can run it, else a ValidationError naming PAGEDLLM_ISA."""
    if level not in LEVELS:
        raise ValidationError.bad_value(ISA_ENV, level, "one of " + ", ".join(LEVELS))
    if LEVELS.index(level) > LEVELS.index(native):
        raise ValidationError(f"{ISA_ENV}={level} is above what this CPU runs (its level is {native}); "
                              f"choose one of {', '.join(LEVELS[:LEVELS.index(native) + 1])}",
                              param=ISA_ENV, value=level)
    return level


@functools.lru_cache(maxsize=1)
def isa_level() -> str:
    """The level kernels run at: the CPU's own, or the lower one ``PAGEDLLM_ISA`` asks for."""
    native = cpu_info().native_level()
    forced = envs.ISA.read()
    return check_level(forced, native) if forced else native


def is_forced() -> bool:
    """True when PAGEDLLM_ISA chose a level below the CPU's own."""
    return isa_level() != cpu_info().native_level()


def native_bf16(level: str | None = None) -> bool:
    """True where bfloat16 dot products run in hardware (AVX512-BF16, AMX)."""
    return (level or isa_level()) in ("avx512_bf16", "amx")


#: torch's own capability caps for a forced level (ATen's kernels, oneDNN, MKL), so that a forced
#: run behaves as on a CPU of that level; they take effect only before torch is imported. (The
#: portable level means "none of pagedllm's kernels"; torch keeps its own dispatch there.)
_TORCH_CAPS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "DNNL_MAX_CPU_ISA": "AVX512_CORE",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx512_bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "DNNL_MAX_CPU_ISA": "AVX512_CORE_BF16"},
}


def cap_torch_to_forced_level(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set (without overriding) torch's capability variables for a forced PAGEDLLM_ISA level.

    Called by ``import pagedllm`` while torch is not imported yet; returns what it set.
    """
    env = os.environ if environ is None else environ
    forced = envs.ISA.read(env)
    caps = _TORCH_CAPS.get(forced, {}) if forced and forced != cpu_info().native_level() else {}
    applied = {k: v for k, v in caps.items() if k not in env}
    env.update(applied)
    return applied


THREADS_BIND_ENV = envs.CPU_OMP_THREADS_BIND.name
"""Cores per local rank, ranks separated by "|" ("0-3|4-7"; as vLLM's VLLM_CPU_OMP_THREADS_BIND),
or "all" (no binding: every rank may use every core). Unset: the cores this process may use,
split evenly between the ranks of this machine."""


def _parse_cores(spec: str) -> list[int]:
    cores: list[int] = []
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        cores.extend(range(int(first), int(last or first) + 1))
    return cores


def _bound_cores(spec: str, local_rank: int, local_world_size: int) -> list[int]:
    """Rank ``local_rank``'s cores of PAGEDLLM_CPU_OMP_THREADS_BIND ("0-3|4-7": one set per rank on this machine)."""
    parts = spec.split("|")
    if len(parts) != local_world_size:
        raise ValidationError(f"{THREADS_BIND_ENV}={spec!r} names {len(parts)} core sets for "
                              f"{local_world_size} ranks on this machine", param=THREADS_BIND_ENV, value=spec)
    try:
        return _parse_cores(parts[local_rank])
    except ValueError:
        raise ValidationError(f"{THREADS_BIND_ENV}={spec!r}: core sets are like 0-3,8 separated by |",
                              param=THREADS_BIND_ENV, value=spec) from None


def rank_cores(local_rank: int, local_world_size: int, environ: dict[str, str] | None = None) -> list[int] | None:
    """The cores local rank ``local_rank`` of ``local_world_size`` binds its threads to (None: no
    binding). Ranks of one machine get disjoint cores so their kernels do not fight over them."""
    env = os.environ if environ is None else environ
    spec = envs.CPU_OMP_THREADS_BIND.read(env)
    if spec == "all":
        return None
    if spec:
        return _bound_cores(spec, local_rank, local_world_size)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < local_world_size:  # more ranks than cores: ranks share them round-robin
        return [cores[local_rank % len(cores)]]
    per_rank = len(cores) // local_world_size
    return cores[local_rank * per_rank:(local_rank + 1) * per_rank]
