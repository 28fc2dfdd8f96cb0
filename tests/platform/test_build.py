"""The kernel build: cached per level, a failure cached with one warning line, and a build killed
halfway (SIGKILL) leaves nothing the next process waits on."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
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


def test_a_build_killed_halfway_leaves_nothing_to_wait_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Also: the build that finishes is cached for its level (the next one runs no compiler)."""
    env = {**os.environ, "PAGEDLLM_CACHE_DIR": str(tmp_path)}
    code = f"from pagedllm.platform import build; build.build({LEVEL!r})"
    victim = subprocess.Popen([sys.executable, "-c", code], env=env)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(f"kernels/{LEVEL}-*/tmp-build-*/")):  # the compilers are running
        assert time.monotonic() < deadline and victim.poll() is None, "the build did not start"
        time.sleep(0.05)
    time.sleep(0.5)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    folder = next(tmp_path.glob(f"kernels/{LEVEL}-*"))
    assert not (folder / build.LIBRARY_NAME).exists()  # nothing half-written in place
    code = ("import logging, time; logging.basicConfig(level=logging.INFO, format='%(created)f %(message)s');"
            f"from pagedllm.platform import build; print('START', time.time()); r = build.build({LEVEL!r});"
            "print('OK' if r.path else r.error)")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.stdout.split()[-1] == "OK", proc.stdout + proc.stderr
    started = float(proc.stdout.split()[1])
    began = float(next(line for line in proc.stderr.splitlines() if "building the" in line).split()[0])
    assert began - started < 3  # the lock died with its holder: no waiting, the build starts at once
    assert (folder / build.LIBRARY_NAME).exists()
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    again = build.build(LEVEL)
    assert again.path == folder / build.LIBRARY_NAME and again.seconds == 0  # cached: no compiler run
    assert folder.name.startswith(f"{LEVEL}-")


def test_build_kernels_command_lists_levels_and_refuses_levels_above_the_cpu(tmp_path: Path) -> None:
    from pagedllm.platform.cpu import LEVELS, cpu_info

    env = {**os.environ, "PAGEDLLM_CACHE_DIR": str(tmp_path)}
    env.pop("PAGEDLLM_ISA", None)
    cli = [sys.executable, "-m", "pagedllm.entrypoints.cli", "build-kernels"]
    listed = subprocess.run([*cli, "--list", "--all"], env=env, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and listed.stdout.startswith("CPU: ")
    assert f"  {LEVEL}: not built yet" in listed.stdout  # --list builds nothing
    built = subprocess.run([*cli], env={**env, "PAGEDLLM_ISA": LEVEL}, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0 and f"  {LEVEL}: built in" in built.stdout
    again = subprocess.run([*cli], env={**env, "PAGEDLLM_ISA": LEVEL}, capture_output=True, text=True, timeout=120)
    assert f"  {LEVEL}: cached: " in again.stdout
    assert not list(tmp_path.glob(f"kernels/{LEVEL}-*/tmp-build-*"))  # a finished build leaves no scratch
    native = cpu_info().native_level()
    if native != LEVELS[-1]:
        above = LEVELS[LEVELS.index(native) + 1]
        refused = subprocess.run([*cli], env={**env, "PAGEDLLM_ISA": above}, capture_output=True, text=True,
                                 timeout=120)
        assert refused.returncode == 2 and f"PAGEDLLM_ISA={above} is above what this CPU runs" in refused.stderr
