"""A non-editable install (`pip install .`) carries the kernel sources and builds its kernels."""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.platform import build
from tests.utils import kernel_levels

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not kernel_levels() or build.compiler() is None, reason="no compiled kernels on this machine")
def test_non_editable_install_generates_with_the_kernels(tmp_path: Path, tiny_llm_dir: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    target = next(venv.glob("lib/python*/site-packages"))
    # the dependencies come from the project's own environment (no downloads); the package itself is installed
    (target / "project_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    # built from a copy: setuptools writes build/ and *.egg-info next to the sources it builds
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True, timeout=600, capture_output=True)
    env = {**os.environ, "PAGEDLLM_CACHE_DIR": str(tmp_path / "cache"), "PAGEDLLM_ISA": kernel_levels()[0]}
    env.pop("PYTHONPATH", None)
    python = str(venv / "bin" / "python")
    where = subprocess.run([python, "-c", "import pagedllm; print(pagedllm.__file__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60)
    assert where.stdout.strip().startswith(str(target)), where.stdout + where.stderr
    proc = subprocess.run([python, "-m", "pagedllm.entrypoints.cli", "generate", "Hello", "--model", str(tiny_llm_dir),
                           "--max-tokens", "4", "--temperature", "0.8", "--num-kv-blocks", "64"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert f"kernels {kernel_levels()[0]}" in proc.stderr and "failed to build" not in proc.stderr
    assert list((tmp_path / "cache").glob("kernels/*/libpagedllm_kernels.so"))
