"""Tensor-parallel engines for the distributed tests, and what a test leaves behind."""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from pagedllm import LLM
from tests.conftest import save_tiny_model

BACKENDS = ["mp", "ray"]


@pytest.fixture(scope="session")
def mqa_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    """A tiny Llama with one KV head (replicated on every rank) and an odd vocabulary (513: padded).
    The default model's tokenizer detokenizes (prompts are token ids below 513)."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-mqa"), "llama3-rope-scaling", vocab_size=513,
                           tokenizer=tokenizer)


@pytest.fixture
def tp_llm() -> Iterator[Callable[..., LLM]]:
    """model, options -> an LLM; every one made is shut down after the test."""
    made: list[LLM] = []

    def make(model: str | Path | None, **options: Any) -> LLM:
        made.append(LLM(None if model is None else str(model), **{"dtype": "float32", **options}))
        return made[-1]

    yield make
    for llm in made:
        llm.shutdown()


def descendants() -> list[psutil.Process]:
    """Every live process this test process started, at any depth."""
    return [p for p in psutil.Process(os.getpid()).children(recursive=True) if p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]


def shm_segments() -> set[str]:
    """Names in /dev/shm (shared-memory segments) now."""
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
