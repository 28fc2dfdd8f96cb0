"""The kernel build: cached per level, a failure cached with one warning line, and a build killed
halfway (SIGKILL) leaves nothing the next process waits on."""
from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from pagedllm.platform import build
from tests.utils import kernel_levels

pytestmark = pytest.mark.skipif(not kernel_levels() or build.compiler() is None,
                                reason="no kernel level on this CPU, or no C++ compiler")
LEVEL = "avx2"  # the cheapest level every kernel-capable x86 CPU runs


def _fake_compiler(tmp_path: Path, exit_code: int) -> Path:
    """A CXX that counts its calls and fails like gcc does."""
    script = tmp_path / "fake-g++"
    script.write_text(f"""#!/bin/sh
echo call >> {tmp_path}/calls
case "$1" in --version) echo "fake 1.0"; exit 0;; esac
echo "kernel.cpp:1:10: error: target specific option mismatch" >&2
echo "  lots of context the log keeps" >&2
exit {exit_code}
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_a_failed_build_is_cached_and_retried_only_when_forced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(_fake_compiler(tmp_path, 1)))
    build._compiler_version.cache_clear()
    result = build.build(LEVEL)
    assert result.path is None and result.error == "kernel.cpp:1:10: error: target specific option mismatch"
    assert "lots of context" in result.log.read_text()
    calls = (tmp_path / "calls").read_text().count("call")
    again = build.build(LEVEL)  # another process, later: reads FAILED, does not compile
    assert again.error == result.error and (tmp_path / "calls").read_text().count("call") == calls
    build.build(LEVEL, force=True)
    assert (tmp_path / "calls").read_text().count("call") > calls


def test_a_failed_build_is_one_warning_line_and_the_engine_falls_back(tmp_path: Path) -> None:
    """A whole process: the kernels fail to build, one WARNING line says which, why, where the
    log is and what runs instead; no compiler output reaches stderr; the model still runs."""
    env = {**os.environ, "PAGEDLLM_CACHE_DIR": str(tmp_path / "cache"), "CXX": str(_fake_compiler(tmp_path, 1)),
           "PAGEDLLM_ISA": LEVEL}
    code = ("import logging, torch; logging.basicConfig(level=logging.INFO, format='%(levelname)s %(message)s');"
            "from pagedllm import platform; print('DTYPE', platform.default_dtype(), platform.kernel_library())")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "avx2 kernels failed to build" in warnings[0]
    assert "target specific option mismatch" in warnings[0] and "build.log" in warnings[0]
    assert "torch's own ops" in warnings[0]
    assert "lots of context" not in proc.stderr and "DTYPE float32 None" in proc.stdout


CLI = [sys.executable, "-m", "pagedllm.entrypoints.cli", "build-kernels"]


@dataclass
class KilledThenBuilt:
    """An empty cache; `build-kernels --list --all` on it; a build SIGKILLed halfway; then `build-kernels`
    (the one full compile both tests below look at: each costs ~25 s of two cores)."""

    cache: Path
    env: dict[str, str]
    listed: subprocess.CompletedProcess
    folder: Path
    half_written: bool
    scratch: set[Path]
    """What the killed build left (its scratch folder, swept by a build an hour later)."""
    built: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def killed_then_built(tmp_path_factory: pytest.TempPathFactory) -> KilledThenBuilt:
    cache = tmp_path_factory.mktemp("kernel-cache")
    env = {**os.environ, "PAGEDLLM_CACHE_DIR": str(cache)}
    env.pop("PAGEDLLM_ISA", None)
    listed = subprocess.run([*CLI, "--list", "--all"], env=env, capture_output=True, text=True, timeout=120)
    code = f"from pagedllm.platform import build; build.build({LEVEL!r})"
    victim = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
    deadline = time.monotonic() + 60
    while not list(cache.glob(f"kernels/{LEVEL}-*/tmp-build-*/")):  # the compilers are running
        assert time.monotonic() < deadline and victim.poll() is None, "the build did not start"
        time.sleep(0.05)
    time.sleep(0.5)
    os.killpg(victim.pid, signal.SIGKILL)  # it and its compilers (as a service manager stops a process group)
    victim.wait()
    folder = next(cache.glob(f"kernels/{LEVEL}-*"))
    half_written = (folder / build.LIBRARY_NAME).exists()
    scratch = set(folder.glob("tmp-build-*"))
    # the command, with the time it started (its imports done) and time-stamped log lines (the build's start)
    code = ("import logging, sys, time; logging.basicConfig(level=logging.INFO, format='%(created)f %(message)s');"
            "from pagedllm.entrypoints import cli; cli.build_parser(); print('START', time.time(), flush=True);"
            "sys.exit(cli.main(['build-kernels']))")
    built = subprocess.run([sys.executable, "-c", code], env={**env, "PAGEDLLM_ISA": LEVEL}, capture_output=True,
                           text=True, timeout=300)
    return KilledThenBuilt(cache, env, listed, folder, half_written, scratch, built)


def test_a_build_killed_halfway_leaves_nothing_to_wait_on(killed_then_built: KilledThenBuilt,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Also: the build that finishes is cached for its level (the next one runs no compiler)."""
    done = killed_then_built
    assert not done.half_written  # nothing half-written in place
    assert done.built.returncode == 0, done.built.stdout + done.built.stderr
    started = float(done.built.stdout.split()[1])
    began = float(re.search(r"^([0-9.]+) building the", done.built.stderr, re.M)[1])  # (the root logger's line)
    assert began - started < 3  # the lock died with its holder: no waiting, the build starts at once
    assert (done.folder / build.LIBRARY_NAME).exists()
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(done.cache))
    again = build.build(LEVEL)
    assert again.path == done.folder / build.LIBRARY_NAME and again.seconds == 0  # cached: no compiler run
    assert done.folder.name.startswith(f"{LEVEL}-")


def test_build_kernels_command_lists_levels_and_refuses_levels_above_the_cpu(
        killed_then_built: KilledThenBuilt) -> None:
    from pagedllm.platform.cpu import LEVELS, cpu_info

    done, env = killed_then_built, killed_then_built.env
    assert done.listed.returncode == 0 and done.listed.stdout.startswith("CPU: ")
    assert f"  {LEVEL}: not built yet" in done.listed.stdout  # --list builds nothing
    assert done.built.returncode == 0 and f"  {LEVEL}: built in" in done.built.stdout
    again = subprocess.run([*CLI], env={**env, "PAGEDLLM_ISA": LEVEL}, capture_output=True, text=True, timeout=120)
    assert f"  {LEVEL}: cached: " in again.stdout
    assert set(done.cache.glob(f"kernels/{LEVEL}-*/tmp-build-*")) == done.scratch  # a finished build leaves none
    native = cpu_info().native_level()
    if native != LEVELS[-1]:
        above = LEVELS[LEVELS.index(native) + 1]
        refused = subprocess.run([*CLI], env={**env, "PAGEDLLM_ISA": above}, capture_output=True, text=True,
                                 timeout=120)
        assert refused.returncode == 2 and f"PAGEDLLM_ISA={above} is above what this CPU runs" in refused.stderr
