"""vLLM's deployment routes and flags through a real `pagedllm serve` (issue 45 point 8): /ping, /invocations,
/load, /v1/chat/completions/batch on the session server; --root-path, --enable-request-id-headers,
--enable-tokenizer-info-endpoint, --enable-server-load-tracking and SageMaker's stateful sessions
(SAGEMAKER_ENABLE_STATEFUL_SESSIONS) on one extra server started with them all (and an API key, as vLLM's root-path
test); `pagedllm chat` / `pagedllm complete` against the session server. SageMaker's /adapters routes: in
tests/lora/test_lora_server.py."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.utils import RemoteServer

KEY = "deploy-key"


@pytest.fixture(scope="module")
def deploy_server(tiny_llm_dir: Path) -> Iterator[RemoteServer]:
    """One server with every deployment flag (plus an API key: the prefix must not slip past it)."""
    srv = RemoteServer(tiny_llm_dir, "--served-model-name", "tiny", "--root-path", "/llm",
                       "--enable-request-id-headers", "--enable-tokenizer-info-endpoint",
                       "--enable-server-load-tracking", "--api-key", KEY,
                       env={**os.environ, "SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "true"})
    yield srv
    srv.stop()


def test_ping_answers_as_health(server: RemoteServer) -> None:
    assert httpx.get(f"{server.url}/ping", timeout=10).status_code == 200
    assert httpx.post(f"{server.url}/ping", timeout=10).status_code == 200


def test_invocations_routes_by_shape(server: RemoteServer) -> None:
    chat = httpx.post(f"{server.url}/invocations", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["object"] == "chat.completion"
    completion = httpx.post(f"{server.url}/invocations", timeout=60,
                            json={"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert completion.status_code == 200, completion.text
    assert completion.json()["object"] == "text_completion"
    # the same reply as the route itself gives
    direct = server.get_client().completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0)
    assert completion.json()["choices"][0]["text"] == direct.choices[0].text


def test_invocations_refuses_what_no_route_takes(server: RemoteServer) -> None:
    neither = httpx.post(f"{server.url}/invocations", json={"model": "tiny", "foo": 1}, timeout=10)
    assert neither.status_code == 400
    assert "Cannot find suitable handler" in neither.json()["error"]["message"]
    bad_chat = httpx.post(f"{server.url}/invocations", timeout=10,
                          json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": "x"})
    assert bad_chat.status_code == 400
    assert bad_chat.json()["error"]["param"] == "max_tokens"
    assert httpx.post(f"{server.url}/invocations", content=b"[1]", timeout=10).status_code == 400


def test_load_is_zero_without_tracking(server: RemoteServer) -> None:
    assert httpx.get(f"{server.url}/load", timeout=10).json() == {"server_load": 0}


def test_flagged_routes_are_off_by_default(server: RemoteServer) -> None:
    response = httpx.get(f"{server.url}/tokenizer_info", timeout=10)
    assert response.status_code == 404
    assert "x-request-id" not in response.headers


def test_batch_chat_completions(server: RemoteServer) -> None:
    conversations = [[{"role": "user", "content": "alpha"}], [{"role": "user", "content": "beta"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "gamma"}]]
    response = httpx.post(f"{server.url}/v1/chat/completions/batch", timeout=60,
                          json={"model": "tiny", "messages": conversations, "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "chat.completion"
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    # each choice is what the conversation alone gives
    alone = server.get_client().chat.completions.create(model="tiny", messages=conversations[1], max_tokens=4,
                                                         temperature=0)
    assert data["choices"][1]["message"]["content"] == alone.choices[0].message.content
    assert 3 <= data["usage"]["completion_tokens"] <= 3 * 4 and data["usage"]["prompt_tokens"] > 0  # the sum
    assert data["usage"]["total_tokens"] == data["usage"]["prompt_tokens"] + data["usage"]["completion_tokens"]


@pytest.mark.parametrize("extra, param", [({"stream": True}, "stream"), ({"n": 2}, "n"),
                                          ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools")])
def test_batch_chat_refuses_what_vllm_refuses(server: RemoteServer, extra: dict, param: str) -> None:
    response = httpx.post(f"{server.url}/v1/chat/completions/batch", timeout=10, json={
        "model": "tiny", "messages": [[{"role": "user", "content": "Hi"}]], **extra})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_batch_chat_names_the_bad_conversation(server: RemoteServer) -> None:
    response = httpx.post(f"{server.url}/v1/chat/completions/batch", timeout=10, json={
        "model": "tiny", "messages": [[{"role": "user", "content": "Hi"}], [{"role": "no body!", "content": "x"}]]})
    assert response.status_code == 400
    assert response.json()["error"]["param"].startswith("messages[1]")
    flat = httpx.post(f"{server.url}/v1/chat/completions/batch", timeout=10,
                      json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]})
    assert flat.status_code == 400 and flat.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("prefix", ["", "/llm"])
def test_root_path_serves_with_and_without_prefix(deploy_server: RemoteServer, prefix: str) -> None:
    good = openai.OpenAI(base_url=f"{deploy_server.url}{prefix}/v1", api_key=KEY, max_retries=0)
    reply = good.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert reply.choices[0].message.role == "assistant"
    bad = openai.OpenAI(base_url=f"{deploy_server.url}{prefix}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.post(f"{deploy_server.url}{prefix}/invocations", json={"prompt": "x"}, timeout=10).status_code == 401


def test_request_id_headers(deploy_server: RemoteServer) -> None:
    own = httpx.get(f"{deploy_server.url}/health", headers={"X-Request-Id": "my-id-42"}, timeout=10)
    assert own.headers["x-request-id"] == "my-id-42"
    fresh = httpx.get(f"{deploy_server.url}/health", timeout=10).headers["x-request-id"]
    assert len(fresh) == 32 and fresh != httpx.get(f"{deploy_server.url}/health", timeout=10).headers["x-request-id"]
    refused = httpx.get(f"{deploy_server.url}/v1/models", headers={"X-Request-Id": "r1"}, timeout=10)
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "r1"
    client = openai.OpenAI(base_url=f"{deploy_server.url}/v1", api_key=KEY, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_headers={"X-Request-Id": "c1"})
    assert raw.headers["x-request-id"] == "c1"


def test_tokenizer_info(deploy_server: RemoteServer, tiny_llm_dir: Path) -> None:
    assert httpx.get(f"{deploy_server.url}/tokenizer_info", timeout=10).status_code == 401
    response = httpx.get(f"{deploy_server.url}/llm/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"},
                         timeout=10)
    assert response.status_code == 200, response.text
    info = response.json()
    assert isinstance(info["tokenizer_class"], str) and info["tokenizer_class"]
    assert isinstance(info.get("chat_template"), str) and info["chat_template"].strip()
    assert isinstance(info.get("eos_token"), str)
    assert str(tiny_llm_dir) not in response.text  # no file names or paths of the server's


def test_server_load_tracking(deploy_server: RemoteServer) -> None:
    load = lambda: httpx.get(f"{deploy_server.url}/llm/load", timeout=10).json()["server_load"]  # noqa: E731
    assert load() == 0
    client = openai.OpenAI(base_url=f"{deploy_server.url}/v1", api_key=KEY, max_retries=0)
    started = threading.Event()

    def stream() -> None:
        chunks = client.completions.create(model="tiny", prompt="Tell a long story", max_tokens=200, stream=True,
                                           extra_body={"ignore_eos": True})
        for _ in chunks:
            started.set()
            time.sleep(0.01)

    worker = threading.Thread(target=stream)
    worker.start()
    assert started.wait(60)
    assert load() == 1
    worker.join(120)
    deadline = time.monotonic() + 10
    while load() != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert load() == 0


SESSION = "X-Amzn-SageMaker-Session-Id"


def test_sagemaker_sessions(deploy_server: RemoteServer) -> None:
    """SageMaker's stateful sessions, as its hosting standard answers them: NEW_SESSION gives an id and its expiry,
    requests name it, CLOSE ends it; a closed or unknown id is a 400, a CLOSE without one a 424."""
    auth = {"Authorization": f"Bearer {KEY}"}
    post = lambda body, **headers: httpx.post(f"{deploy_server.url}/invocations", json=body,  # noqa: E731
                                              headers={**auth, **headers}, timeout=60)
    opened = post({"requestType": "NEW_SESSION"})
    assert opened.status_code == 200, opened.text
    session, expires = opened.headers["x-amzn-sagemaker-new-session-id"].split("; ")
    assert re.fullmatch(r"[0-9a-f-]{36}", session) and re.fullmatch(r"Expires=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", expires)
    used = post({"model": "tiny", "prompt": "Hello", "max_tokens": 2}, **{SESSION: session})
    assert used.status_code == 200 and used.json()["object"] == "text_completion", used.text
    ask = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
    for body, headers, status, words in [
            (ask, {SESSION: "no-such-session"}, 400, "session not found"),
            ({"requestType": "CLOSE"}, {SESSION: "no-such-session"}, 400, "session not found"),
            ({"requestType": "CLOSE", "extra": 1}, {SESSION: session}, 400, "requestType only"),
            ({"requestType": "OPEN"}, {}, 400, "requestType"),
            ({"requestType": "CLOSE"}, {}, 424, "invalid session_id")]:
        r = post(body, **headers)
        assert r.status_code == status and words in r.json()["error"]["message"], (body, r.text)
    closed = post({"requestType": "CLOSE"}, **{SESSION: session})
    assert closed.status_code == 200 and closed.headers["x-amzn-sagemaker-closed-session-id"] == session
    assert post({"requestType": "CLOSE"}, **{SESSION: session}).status_code == 400  # closed already
    assert httpx.post(f"{deploy_server.url}/invocations", json={"requestType": "NEW_SESSION"},
                      timeout=10).status_code == 401  # the key still guards it


def test_sagemaker_sessions_are_off_by_default(server: RemoteServer) -> None:
    r = httpx.post(f"{server.url}/invocations", json={"requestType": "NEW_SESSION"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "requestType", r.text
    assert "--enable-sagemaker-sessions" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/invocations", json={"model": "tiny", "prompt": "x", "max_tokens": 1},
                   headers={SESSION: "abc"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == SESSION, r.text


def test_sagemaker_adapters_route_needs_the_key(deploy_server: RemoteServer) -> None:
    """/adapters loads adapters as /v1/load_lora_adapter does: the API key guards it (even where it is off)."""
    assert httpx.post(f"{deploy_server.url}/adapters", json={"name": "a", "src": "/x"}, timeout=10).status_code == 401
    assert httpx.delete(f"{deploy_server.url}/llm/adapters/a", timeout=10).status_code == 401


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_chat_cli_quick(server: RemoteServer) -> None:
    done = _cli("chat", "--url", f"{server.url}/v1", "--system-prompt", "Be brief.", "-q", "Hello")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Using model: tiny\n")  # the first model /v1/models lists
    assert len(done.stdout) > len("Using model: tiny\n")


def test_complete_cli_quick(server: RemoteServer) -> None:
    done = _cli("complete", "--url", f"{server.url}/v1", "--model-name", "tiny", "--max-tokens", "5", "--stats",
                "-q", "The capital of France is")
    assert done.returncode == 0, done.stderr
    assert "Using model: tiny" in done.stdout and "TPS:" in done.stdout
    wrong = _cli("complete", "--url", f"{server.url}/v1", "--model-name", "nope", "-q", "x")
    assert wrong.returncode == 1 and "404" in wrong.stderr
