"""Engines on the tiny random model (tests/conftest.py's ``tiny_llm_dir``) for the engine tests."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pagedllm import LLM


@pytest.fixture(scope="session")
def make_llm(tiny_llm_dir: Path) -> Callable[..., LLM]:
    """Engine options -> a fresh LLM on the tiny model, in float32 unless ``dtype`` says otherwise."""

    def make(**options: Any) -> LLM:
        return LLM(str(tiny_llm_dir), **{"dtype": "float32", **options})

    return make


@pytest.fixture(scope="module")
def llm(make_llm: Callable[..., LLM], request: pytest.FixtureRequest) -> LLM:
    """One LLM shared by a test module, built with the module's ``LLM_OPTIONS`` (a dict)."""
    return make_llm(**request.module.LLM_OPTIONS)
