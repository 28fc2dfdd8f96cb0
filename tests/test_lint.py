"""The sources pass ruff (pyproject.toml's [tool.ruff]) and the C++ kernels clang-format (.clang-format):
the same checks as `make lint`."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PATHS = ["pagedllm", "tests", "benchmarks", "examples"]
CPP_GLOBS = ["pagedllm/csrc/*.cpp", "pagedllm/csrc/*.h"]


def test_ruff_check_passes() -> None:
    if importlib.util.find_spec("ruff") is None:
        # a dev dependency: failing (not skipping) keeps a missing linter from passing unnoticed
        pytest.fail(f"ruff is not installed in {sys.executable}'s environment: run `make` "
                    "(it installs the dev dependencies, ruff among them)")
    # --no-cache: the test writes nothing into the tree
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *PATHS], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"`ruff check {' '.join(PATHS)}` failed:\n{proc.stdout}{proc.stderr}"


def test_the_rule_set_is_wider_than_pycodestyle() -> None:
    """Beyond pycodestyle and pyflakes: imports sorted (I), pyupgrade (UP) and bugbear (B); a rule left out says
    why in pyproject.toml."""
    import tomllib

    lint = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert {"E", "F", "W", "I", "UP", "B"} <= set(lint["select"])
    assert set(lint.get("ignore", [])) <= {"B905"}, "a rule newly ignored: say why in pyproject.toml, then here"


def test_clang_format_passes() -> None:
    if importlib.util.find_spec("clang_format") is None:
        # a dev dependency, as ruff: fail rather than skip
        pytest.fail(f"clang-format is not installed in {sys.executable}'s environment: run `make` "
                    "(it installs the dev dependencies, clang-format among them)")
    # versions format some lines differently: the check means something with the pinned one only
    pin = re.search(r'"clang-format==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin, "pyproject.toml's dev dependencies pin no clang-format version"
    installed = importlib.metadata.version("clang-format")
    if installed != pin.group(1):
        pytest.fail(f"clang-format {installed} is installed, pyproject.toml pins {pin.group(1)}: run `make`")
    exe = Path(sysconfig.get_path("scripts")) / "clang-format"  # the package's entry point, beside python
    files = sorted(str(p.relative_to(ROOT)) for pattern in CPP_GLOBS for p in ROOT.glob(pattern))
    assert files, CPP_GLOBS
    proc = subprocess.run([str(exe), "--dry-run", "-Werror", *files], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, (f"`clang-format --dry-run -Werror {' '.join(CPP_GLOBS)}` failed (run "
                                  f"`{exe} -i` on the files to fix them):\n{proc.stdout}{proc.stderr}")
