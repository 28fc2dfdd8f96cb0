"""The server's API fuzzed by schemathesis from its own /openapi.json (bounded: a fixed number of examples
per operation, derandomized, a short context so no request generates for long): no 5xx, every 4xx in
OpenAI's error shape (Anthropic's on /v1/messages, Cohere's on /cohere/), and afterwards the server alive,
answering a normal request, every KV block free."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.utils import RemoteServer

EXAMPLES = 15
"""Per operation (22 operations): about 35 s in all on 2 cores."""


@pytest.fixture(scope="module")
def fuzzed(tiny_llm_dir: Path) -> Iterator[RemoteServer]:
    srv = RemoteServer(tiny_llm_dir, "--max-model-len", "64", "--num-kv-blocks", "64", "--served-model-name", "tiny")
    yield srv
    srv.stop()


def _check(case: schemathesis.Case) -> None:
    response = case.call(timeout=60)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    if response.status_code >= 400:
        body = response.json()
        if case.path.startswith("/cohere/"):  # Cohere's shape: {"message"} (the message names the field)
            assert set(body) == {"message"} and isinstance(body["message"], str) and body["message"], body
            return
        error = body["error"]
        if case.path.startswith("/v1/messages"):  # Anthropic's shape: {"type": "error", "error": {"type", "message"}}
            assert body["type"] == "error" and set(error) == {"type", "message"}, body
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
        assert set(error) <= {"message", "type", "param", "code"}


def test_fuzzed_requests_get_answers_not_crashes(fuzzed: RemoteServer) -> None:
    """Every operation of the schema, EXAMPLES generated cases each (schemathesis' pytest plugin does not run
    under this pytest: the operations' hypothesis strategies are driven directly)."""
    schema = schemathesis.openapi.from_url(f"{fuzzed.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses", "POST /v1/messages",
            "POST /v1/messages/count_tokens", "GET /v1/responses/{response_id}"} <= {op.label for op in operations}
    for operation in operations:
        run = given(case=operation.as_strategy())(_check)
        settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                 suppress_health_check=list(HealthCheck))(run)()


def test_server_alive_and_clean_after_fuzzing(fuzzed: RemoteServer) -> None:
    assert fuzzed.proc.poll() is None and httpx.get(f"{fuzzed.url}/health", timeout=5).status_code == 200
    r = httpx.post(f"{fuzzed.url}/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    stats = httpx.get(f"{fuzzed.url}/stats", timeout=5).json()
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0
