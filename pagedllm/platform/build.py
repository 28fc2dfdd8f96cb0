"""Builds the C++ kernel library once per instruction-set level, and caches it (or its failure).

One shared library per level from ``pagedllm/csrc/*.cpp``, compiled with that level's flags
only (never an instruction the level lacks) and called through ctypes (layers/cpu_ops.py): no
torch headers, so a build takes seconds, and the build does not depend on torch's version.

The cache lives under ``$PAGEDLLM_CACHE_DIR`` (default ``~/.cache/pagedllm``), one folder per
level and hash of (sources, flags, compiler): ``kernels/<level>-<hash>/``. A build is safe to
kill at any point: objects and the library are written to a private temporary folder and moved
in place with one atomic rename; the lock is an ``flock``, which the OS drops when its holder
dies, so the next process never waits on what a killed one left. A failed build writes
``FAILED`` (the first compiler error) and ``build.log`` there; later processes read it instead of
compiling again, until the sources, flags or compiler change (or ``pagedllm build-kernels --force``).
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pagedllm import envs
from pagedllm.platform.cpu import LEVELS

logger = logging.getLogger(__name__)

CACHE_ENV = envs.CACHE_DIR.name
SOURCE_DIR = Path(__file__).resolve().parent.parent / "csrc"
LIBRARY_NAME = "libpagedllm_kernels.so"
LOCK_WAIT_S = 180.0
"""How long to wait for a live process building the same library before building privately."""

_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = _AVX2 + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
LEVEL_FLAGS: dict[str, tuple[str, ...]] = {
    "avx2": _AVX2,
    "avx512": _AVX512,
    "avx512_bf16": _AVX512 + ("-mavx512bf16", "-mavx512vnni"),
}
"""Compiler flags per level; "amx" runs the avx512_bf16 library (its GEMMs go to oneDNN's AMX path)."""

# -ffp-contract=off: a product torch rounds before a sum stays rounded (the fused ops match torch
# bit for bit); -fopenmp: the parallel regions bind to the libgomp.so.1 torch has already loaded
COMMON_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-fopenmp", "-ffp-contract=off", "-fno-math-errno",
                "-fvisibility=hidden", "-Wall")


def library_level(level: str) -> str | None:
    """The library a level runs (None: torch's own ops only)."""
    assert level in LEVELS, level
    return {"portable": None, "amx": "avx512_bf16"}.get(level, level)


def cache_root() -> Path:
    """``$PAGEDLLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedllm``, else ``~/.cache/pagedllm``."""
    if envs.CACHE_DIR.read():
        return Path(envs.CACHE_DIR.read()).expanduser()
    base = envs.XDG_CACHE_HOME.read() or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedllm"


def sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.cpp"))


def compiler() -> str | None:
    """The C++ compiler: $CXX, else g++, else c++ (None when there is none)."""
    for name in (envs.CXX.read(), "g++", "c++"):
        if name and shutil.which(name):
            return name
    return None


@functools.lru_cache(maxsize=4)
def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@dataclass(frozen=True)
class BuildResult:
    """Where a level's library is, or why there is none."""

    level: str
    path: Path | None
    error: str | None = None
    """The first line of the compiler's error (or what stopped the build)."""
    log: Path | None = None
    seconds: float = 0.0
    """Time spent compiling in this call (0 when the cached library or failure was used)."""


def build_dir(level: str) -> Path:
    """The cache folder of ``level``'s library for these sources, flags and compiler."""
    cxx = compiler()
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.glob("*")):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(repr((level, LEVEL_FLAGS[level], COMMON_FLAGS, cxx and _compiler_version(cxx))).encode())
    return cache_root() / "kernels" / f"{level}-{digest.hexdigest()[:16]}"


def build(level: str, force: bool = False) -> BuildResult:
    """The cached library of ``level`` (a library level), building it first if needed.

    With ``force``, a cached failure is forgotten and the build retried.
    """
    assert level in LEVEL_FLAGS, level
    folder = build_dir(level)
    lib, failed = folder / LIBRARY_NAME, folder / "FAILED"
    if lib.exists():
        return BuildResult(level, lib)
    if failed.exists() and not force:
        return BuildResult(level, None, failed.read_text().strip() or "unknown error", folder / "build.log")
    folder.mkdir(parents=True, exist_ok=True)
    with _flock(folder / "lock"):
        if lib.exists():  # another process built it while we waited
            return BuildResult(level, lib)
        if failed.exists() and not force:
            return BuildResult(level, None, failed.read_text().strip(), folder / "build.log")
        failed.unlink(missing_ok=True)
        return _compile(level, folder)


def _compile(level: str, folder: Path) -> BuildResult:
    cxx = compiler()
    log_path = folder / "build.log"
    if cxx is None:
        return _fail(level, folder, "no C++ compiler found (install g++ or set CXX)", "")
    start = time.monotonic()
    for stale in folder.glob("tmp-build-*"):  # left by a process killed mid-build an hour ago or more
        if time.time() - stale.stat().st_mtime > 3600:
            shutil.rmtree(stale, ignore_errors=True)
    logger.info("building the %s kernels (once; cached in %s)", level, folder)
    with tempfile.TemporaryDirectory(prefix="tmp-build-", dir=folder) as tmp:
        flags = [*COMMON_FLAGS, *LEVEL_FLAGS[level], f'-DPL_LEVEL="{level}"', f"-I{SOURCE_DIR}"]
        objects = [Path(tmp) / (src.stem + ".o") for src in sources()]
        # one compiler per source, side by side: the files are independent
        procs = [subprocess.Popen([cxx, *flags, "-c", str(src), "-o", str(obj)], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for src, obj in zip(sources(), objects)]
        try:
            log = "".join(p.communicate()[0] for p in procs)
        finally:  # interrupted (Ctrl-C): no compiler outlives the build
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if all(p.returncode == 0 for p in procs):
            link = subprocess.run([cxx, "-shared", "-fopenmp", *map(str, objects), "-o", str(Path(tmp) / LIBRARY_NAME)],
                                  capture_output=True, text=True)
            log += link.stdout + link.stderr
            if link.returncode == 0:
                log_path.write_text(log)
                os.replace(Path(tmp) / LIBRARY_NAME, folder / LIBRARY_NAME)  # atomic: whole library or none
                seconds = time.monotonic() - start
                logger.info("built the %s kernels in %.1f s", level, seconds)
                return BuildResult(level, folder / LIBRARY_NAME, seconds=seconds)
        return _fail(level, folder, _first_error(log), log, time.monotonic() - start)


def _fail(level: str, folder: Path, error: str, log: str, seconds: float = 0.0) -> BuildResult:
    (folder / "build.log").write_text(log or error)
    tmp = folder / f"FAILED.{os.getpid()}"
    tmp.write_text(error + "\n")
    os.replace(tmp, folder / "FAILED")
    return BuildResult(level, None, error, folder / "build.log", seconds)


def _first_error(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower():
            return line
    return lines[0] if lines else "the compiler failed without a message"


class _flock:
    """An exclusive flock on ``path``: released by the OS if the holder dies; waits at most
    LOCK_WAIT_S for a live holder, then goes on without it (a private build, renamed atomically)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def __enter__(self) -> _flock:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    logger.warning("another process has held %s for %.0f s; building without it", self.path,
                                   LOCK_WAIT_S)
                    return self
                time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        assert self.fd is not None
        os.close(self.fd)  # closing drops the lock
