"""Tensor-parallel engines for the distributed tests (what a test leaves behind: tests/distributed/utils.py)."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedllm import LLM
from tests.utils import save_tiny_model


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
