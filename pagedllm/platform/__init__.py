"""The one place that knows the machine: the CPU, its instruction-set level (``isa_level``; ``active_level``
with a test's ``use_level``), which compiled kernel library exists there (``kernel_library``), CPU or CUDA
(``resolve_device``), the dtype that runs fastest, and the environment switches (read once). Layers ask it
once, when the model loads (layers/custom_op.py), never per call.

Everything else asks this module; nothing else reads /proc/cpuinfo (the PAGEDLLM_* variables are pagedllm.envs').

Which CPUs get which path (``pagedllm build-kernels --list`` shows this machine's):

===============  =========================================  =====================================
level            CPUs                                       kernels
===============  =========================================  =====================================
amx              Intel Xeon 4th gen+ (Sapphire Rapids)      avx512_bf16 library, GEMMs via oneDNN
avx512_bf16      AMD Zen 4/5, Intel Cooper Lake             vdpbf16ps GEMM and attention q.k
avx512           Intel Skylake-X .. Ice Lake, Cascade Lake  FMA kernels on 16 lanes
avx2             AMD Zen 1-3, Intel Haswell+, most laptops  FMA kernels on 8 lanes
portable         ARM (Graviton, Ampere, Apple), older x86   torch's own ops (NEON/SVE inside)
===============  =========================================  =====================================
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from pagedllm import envs
from pagedllm.errors import ValidationError
from pagedllm.platform import build
from pagedllm.platform.cpu import ISA_ENV, LEVELS, CpuInfo, check_level, cpu_info, is_forced, isa_level, native_bf16

__all__ = ["ISA_ENV", "LEVELS", "CpuInfo", "KernelLibrary", "Switches", "active_level", "bf16_gemm", "check_level",
           "cpu_info", "default_dtype", "describe", "is_cpu", "is_cuda", "is_forced", "isa_level", "kernel_library",
           "native_bf16", "resolve_device", "switches", "use_level"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Switches:
    """PAGEDLLM_* switches for A/B measurements, read once at start-up."""

    fused_ops: bool
    """PAGEDLLM_FUSED_OPS=0 turns the compiled GEMM and fused ops off (torch's expressions serve)."""
    gemm: str
    """PAGEDLLM_GEMM: "auto" (ours where it suits, oneDNN on AMX CPUs) or "onednn" (oneDNN for bf16 always)."""
    cpu_stack: bool
    """PAGEDLLM_CPU_STACK=0 runs the decoder layers one by one from Python instead of in one compiled call."""
    dense_copy: str = "auto"
    """PAGEDLLM_DENSE_COPY: "auto", "1" or "0": a dense copy beside weights kept quantized (layers/quant.py)."""


@functools.lru_cache(maxsize=1)
def switches() -> Switches:
    return Switches(envs.FUSED_OPS.read(), envs.GEMM.read(), envs.CPU_STACK.read(), envs.DENSE_COPY.read())


@dataclass(frozen=True)
class KernelLibrary:
    """The loaded kernel library (ctypes) and the level it was built for."""

    level: str
    lib: ctypes.CDLL
    path: str


_level: str | None = None
"""The level ``use_level`` set (None: ``isa_level()``)."""


def active_level() -> str:
    """The level the layers and the cpu attention backend bind now: the process's (``isa_level``), or the one
    ``use_level`` set (its kernels may come from a lower one: see ``kernel_library``)."""
    return _level or isa_level()


@contextlib.contextmanager
def use_level(level: str) -> Iterator[None]:
    """Inside, ``active_level()`` is ``level`` (a level this process runs: the CPU's own or PAGEDLLM_ISA's, or one
    below; "portable": no kernels). Layers built (or bound) inside run that level's kernels: tests cover every
    level below the machine's own this way."""
    global _level
    before, _level = _level, check_level(level, isa_level())
    try:
        yield
    finally:
        _level = before


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" when torch sees a GPU, else "cpu"; "cuda" without one is refused (ValidationError on
    ``device``); "cpu" stays. The one answer to CPU-or-CUDA. torch must be imported first (as for the kernels:
    this module imports no torch, tests/test_layering.py)."""
    assert "torch" in sys.modules, "import torch before asking whether it sees a GPU"
    torch = sys.modules["torch"]
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValidationError("device 'cuda' was asked for but torch sees no CUDA device (this torch build: "
                              f"{torch.__version__})", param="device", value=device)
    return device


def is_cuda(device: object) -> bool:
    """Whether ``device`` (a resolved device name, or a ``torch.device``) is a CUDA GPU: the one test of it
    outside this module's own (tests/test_layering.py)."""
    return getattr(device, "type", device) == "cuda"


def is_cpu(device: object) -> bool:
    """Whether ``device`` (a resolved device name, or a ``torch.device``) is the CPU: the one test of it outside this
    module's own (tests/test_layering.py)."""
    return getattr(device, "type", device) == "cpu"


def bf16_gemm() -> str:
    """Who multiplies a bf16 weight at the active level, the one reading of PAGEDLLM_GEMM (layers/prepack.py and
    the memory plan ask it): "onednn" (oneDNN's packed matmul for every bf16 weight: PAGEDLLM_GEMM=onednn), "amx"
    (the amx level: our AMX GEMM over the plain weight at few rows where its shape suits, oneDNN's otherwise) or
    "ours" (our packed GEMM). oneDNN is asked only where torch has it (layers/prepack.py)."""
    if switches().gemm == "onednn":
        return "onednn"
    return "amx" if active_level() == "amx" else "ours"


def kernel_library(level: str | None = None) -> KernelLibrary | None:
    """The compiled kernel library (ctypes) for ``level`` (default: the process's, ``isa_level``), built or taken
    from the cache; where it does not build, the next level down (one WARNING line says which and why);
    None at the portable level or when none builds. torch must be imported first, so that the
    library's OpenMP calls bind to the libgomp.so.1 torch loaded (one thread pool for both)."""
    return _library(level or isa_level())


@functools.cache
def _library(level: str) -> KernelLibrary | None:
    assert "torch" in sys.modules, "import torch before loading the kernels (one OpenMP runtime)"
    wanted = build.library_level(level)
    if wanted is None:
        return None
    first_failure: build.BuildResult | None = None
    for candidate in reversed(LEVELS[1:LEVELS.index(wanted) + 1]):
        result = build.build(candidate)
        lib, built_for = _open(result.path) if result.path is not None else (None, "")
        if result.path is not None and built_for != candidate:
            result = build.BuildResult(candidate, None, f"the cached library was built for {built_for}",
                                       result.path)
        if result.path is not None:
            _warn(first_failure, candidate)
            return KernelLibrary(candidate, lib, str(result.path))
        first_failure = first_failure or result
    _warn(first_failure, None)
    return None


def _open(path: object) -> tuple[ctypes.CDLL | None, str]:
    """(the compiled library at ``path``, the level it was built for), or (None, why it does not load)."""
    try:
        lib = ctypes.CDLL(str(path))
        lib.pl_level.restype = ctypes.c_char_p
        return lib, lib.pl_level().decode()
    except (OSError, AttributeError) as e:
        return None, f"nothing: it does not load ({e})"


def _warn(failure: build.BuildResult | None, taken: str | None) -> None:
    if failure is None:
        return
    instead = f"using the {taken} kernels" if taken else "using torch's own ops (the portable path, slower)"
    logger.warning("the %s kernels failed to build (%s; log: %s); %s", failure.level, failure.error, failure.log,
                   instead)


def default_dtype() -> str:
    """What ``dtype="auto"`` runs: bfloat16 where bf16 dot products are native, and on AVX2 /
    AVX-512 CPUs where the kernels built (bf16 storage with float32 arithmetic inside the kernels
    halves the bytes a decode step reads: measured faster, docs/BENCHMARKS.md); float32 elsewhere
    (torch's own bf16 ops emulate it slowly there)."""
    level = isa_level()
    if native_bf16(level):
        return "bfloat16"
    if level != "portable" and switches().fused_ops and kernel_library() is not None:
        return "bfloat16"
    return "float32"


def describe(dtype: str) -> str:
    """The one line logged at start, e.g. ``CPU: AMD EPYC, AVX2+FMA (no AVX-512): kernels avx2,
    dtype bfloat16 storage / float32 compute``."""
    cpu = cpu_info()
    lib = kernel_library()
    active = lib.level if lib is not None else "portable (torch ops)"
    if not switches().fused_ops and lib is not None:
        active += " (attention only: PAGEDLLM_FUSED_OPS=0)"
    forced = f" [{ISA_ENV}={isa_level()}]" if is_forced() else ""
    if dtype == "float32" or (dtype == "bfloat16" and native_bf16(lib.level if lib else "portable")):
        dtype_text = dtype
    else:
        dtype_text = f"{dtype} storage / float32 compute" if lib is not None else f"{dtype} (torch ops)"
    return f"CPU: {cpu.model_name}, {cpu.features()}{forced}: kernels {active}, dtype {dtype_text}"
