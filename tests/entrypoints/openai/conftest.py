"""A real `pagedllm serve` process on a free 127.0.0.1 port, serving the tiny model, and an OpenAI client of it."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.utils import RemoteServer


@pytest.fixture(scope="session")
def server(tiny_llm_dir: Path) -> Iterator[RemoteServer]:
    srv = RemoteServer(tiny_llm_dir, "--served-model-name", "tiny")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    """An OpenAI client of the module's ``server``."""
    return server.get_client()
