"""Shared fixtures: the default model, its tokenizer, tiny random models saved with transformers, and the kernel
levels (the helpers they call are tests/utils.py's)."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import pagedllm  # noqa: F401  (first: a PAGEDLLM_ISA level caps torch's own kernels before torch loads)
from tests.utils import at_kernel_level, kernel_levels, save_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever fetched from a hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

NO_KERNELS = "no compiled kernel level here: the CPU (or PAGEDLLM_ISA) allows only the portable one"


@pytest.fixture(params=kernel_levels() or [pytest.param(None, marks=pytest.mark.skip(reason=NO_KERNELS))])
def kernels(request: pytest.FixtureRequest) -> Any:
    """The CpuKernels of one level (each level this CPU runs), made the active level for the test."""
    context, active = at_kernel_level(request.param)
    yield active
    context.__exit__(None, None, None)


@pytest.fixture(params=["portable", *kernel_levels()])
def level(request: pytest.FixtureRequest) -> Any:
    """Each level this CPU runs, the portable one (torch's own ops) included, made the active level."""
    context, _ = at_kernel_level(request.param)
    yield request.param
    context.__exit__(None, None, None)


@pytest.fixture(scope="session")
def default_model() -> str:
    from pagedllm.models.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(default_model: str) -> Any:
    from pagedllm.models.loader import load_tokenizer

    return load_tokenizer(default_model)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """variant -> folder with a tiny random model (vocab 512) and a word-level tokenizer of its vocabulary."""
    from tests.tiny_tokenizer import save_word_tokenizer

    cache: dict[str, Path] = {}

    def make(variant: str) -> Path:
        if variant not in cache:
            cache[variant] = save_tiny_model(tmp_path_factory.mktemp(variant), variant)
            save_word_tokenizer(cache[variant], 512)
        return cache[variant]

    return make


@pytest.fixture(scope="session")
def tiny_llm_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    """A tiny random Llama with the default model's tokenizer: fast engine tests with real text."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llm"), "llama-gqa-untied",
                           vocab_size=len(tokenizer), tokenizer=tokenizer)


@pytest.fixture(scope="session")
def make_llm(tiny_llm_dir: Path) -> Callable[..., Any]:
    """Engine options -> a fresh LLM on the tiny model, in float32 unless ``dtype`` says otherwise."""
    from pagedllm import LLM

    def make(**options: Any) -> LLM:
        return LLM(str(tiny_llm_dir), **{"dtype": "float32", **options})

    return make
