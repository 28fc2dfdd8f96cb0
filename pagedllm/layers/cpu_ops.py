"""Fused C++ element-wise ops and the bf16 GEMM for AVX512-BF16 CPUs (csrc/fused_ops.cpp, gemm_bf16.cpp).

A decode step of SmolLM2-135M at 256 sequences spent ~15 ms of ~157 ms in the torch ops of RMSNorm,
rotary and SiLU-and-mul (each a chain of 4-8 ops, each reading and writing the whole activation).
The fused ops read each element once. Built on first use with torch.utils.cpp_extension (cached
under ~/.cache/torch_extensions); where the build fails (no compiler, no AVX512-BF16) the layers
keep their torch expressions, which the fused ops reproduce rounding for rounding. The sampler's
inverse-CDF draw is fused too (bf16 or float32 logits; ~9 ms of that step went to its torch ops).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_SOURCES = [os.path.join(os.path.dirname(__file__), "csrc", name) for name in ("fused_ops.cpp", "gemm_bf16.cpp")]
_HEADER = os.path.join(os.path.dirname(__file__), "csrc", "simd_bf16.h")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def build_extension(name: str, sources: list[str], cflags: list[str], ldflags: list[str],
                    headers: tuple[str, ...] = ()) -> ModuleType:
    """torch.utils.cpp_extension.load under a name that carries a hash of the sources: two checkouts
    (or versions) of pagedllm on one machine each keep their own cached build instead of
    rebuilding over each other's in ~/.cache/torch_extensions (a build takes ~20-40 s)."""
    from torch.utils.cpp_extension import load

    digest = hashlib.sha1()
    for path in [*sources, *headers]:
        with open(path, "rb") as f:
            digest.update(f.read())
    return load(name=f"{name}_{digest.hexdigest()[:10]}", sources=sources, verbose=False,
                extra_cflags=cflags, extra_ldflags=ldflags)


@functools.lru_cache(maxsize=1)
def load_ops() -> ModuleType | None:
    """The built extension (fused ops and the bf16 GEMM), or None where it does not build."""
    try:
        logger.info("loading the fused C++ element-wise ops (built once, then cached)")
        # -march=native: the build is cached per machine; -fopenmp: at::parallel_for's pragmas;
        # -ffp-contract=off: a product rounded before its sum stays so (torch's rounding, not an FMA's)
        return build_extension("pagedllm_fused_ops", _SOURCES,
                               ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"], ["-fopenmp"], (_HEADER,))
    except Exception as e:  # no compiler, no AVX512-BF16, a build error: the torch expressions serve
        logger.warning("fused C++ ops unavailable (%s); using torch ops for norm/rotary/SiLU", e)
        return None


def fused_ops(x: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> ModuleType | None:
    """The fused ops module when ``x`` is a CPU tensor of one of ``dtypes`` and the ops build here,
    else None. ``PAGEDLLM_FUSED_OPS=0`` turns them off (the torch expressions serve)."""
    if x.dtype not in dtypes or x.device.type != "cpu" or os.environ.get("PAGEDLLM_FUSED_OPS", "1") == "0":
        return None
    return load_ops()
