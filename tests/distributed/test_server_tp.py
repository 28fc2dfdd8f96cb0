"""The OpenAI-client tests again, against `pagedllm serve --tensor-parallel-size 2` (mp workers).

The test functions are the server suite's own (imported); only the ``server`` fixture differs (``client``,
its OpenAI client, is defined here too: the suite's conftest.py does not reach this folder).
Dropped streams free their blocks in the one central pool, which is every rank's (the same block
ids), and the workers forget the requests with the next step.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.entrypoints.openai.test_load import test_dropped_streams_free_everything  # noqa: F401
from tests.entrypoints.openai.test_openai_client import (  # noqa: F401
    test_beam_search_and_prefix_cache_metrics,
    test_chat_logprobs,
    test_chat_usage_counts_are_the_tokenizers,
    test_completion_logprobs,
    test_completion_usage_counts_are_the_tokenizers,
    test_models,
    test_n_samples_and_seed,
    test_prompt_forms_and_echo,
    test_stop_string,
    test_streamed_chat_joins_to_the_greedy_text,
    test_streamed_completion_joins_to_the_greedy_text,
    test_tokenize_detokenize_version,
)
from tests.utils import RemoteServer


@pytest.fixture(scope="module")
def server(tiny_llm_dir: Path) -> Iterator[RemoteServer]:
    srv = RemoteServer(tiny_llm_dir, "--served-model-name", "tiny", "--tensor-parallel-size", "2")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.get_client()
