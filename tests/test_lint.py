"""The sources pass ruff (pyproject.toml's [tool.ruff]): the same check as `make lint`."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PATHS = ["pagedllm", "tests", "benchmarks", "examples"]


def test_ruff_check_passes() -> None:
    if importlib.util.find_spec("ruff") is None:
        # a dev dependency: failing (not skipping) keeps a missing linter from passing unnoticed
        pytest.fail(f"ruff is not installed in {sys.executable}'s environment: run `make` "
                    "(it installs the dev dependencies, ruff among them)")
    # --no-cache: the test writes nothing into the tree
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *PATHS], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"`ruff check {' '.join(PATHS)}` failed:\n{proc.stdout}{proc.stderr}"
