"""Engines on the tiny random model (tests/conftest.py's ``tiny_llm_dir``) for the engine tests."""
from __future__ import annotations

from collections.abc import Callable

import pytest

from pagedllm import LLM


@pytest.fixture(scope="module")
def llm(make_llm: Callable[..., LLM], request: pytest.FixtureRequest) -> LLM:
    """One LLM shared by a test module, built with the module's ``LLM_OPTIONS`` (a dict)."""
    return make_llm(**request.module.LLM_OPTIONS)
