"""`pagedllm launch render` (vLLM's `vllm launch render`, issue 45): a render-only server started from a model's
configuration and tokenizer alone (its weights may be absent: none are loaded, no KV cache is sized) answers the
render, derender and tokenizer routes as a full `pagedllm serve --enable-scale-out` answers them, and nothing
else (every generation route is a 404); /v1/responses/render gives the generate request of a Responses request."""
from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.utils import RemoteServer, thread_engine

ASK = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def render_server(tiny_llm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    """The render-only server on a copy of the tiny model without its weights."""
    folder = tmp_path_factory.mktemp("no-weights")
    for f in tiny_llm_dir.iterdir():
        if f.suffix not in (".safetensors", ".bin", ".gguf"):
            shutil.copy(f, folder / f.name)
    s = RemoteServer(folder, "--served-model-name", "tiny", "--max-model-len", "256", command=("launch", "render"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def full(tiny_llm_dir: Path) -> Iterator[Any]:
    """The same model served whole, in this process, with the render routes on."""
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.entrypoints.openai.metrics import ServerMetrics

    engine = thread_engine(tiny_llm_dir, max_model_len=256)
    with TestClient(build_app(engine, ServerMetrics("t"), ["tiny"], [], enable_scale_out=True)) as http:
        yield http


def test_renders_as_the_full_server_renders(render_server: RemoteServer, full: Any) -> None:
    url = render_server.url
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]] == ["tiny"]
    chat = {"model": "tiny", "messages": ASK, "max_tokens": 9, "temperature": 0.0}
    mine = httpx.post(url + "/v1/chat/completions/render", json=chat, timeout=30).json()
    theirs = full.post("/v1/chat/completions/render", json=chat).json()
    for key in ("token_ids", "sampling_params", "model", "parse_context"):
        assert mine[key] == theirs[key], key
    completion = {"model": "tiny", "prompt": ["Hello", "Good day"], "max_tokens": 5}
    rendered = httpx.post(url + "/v1/completions/render", json=completion, timeout=30).json()
    assert [r["token_ids"] for r in rendered] == \
        [r["token_ids"] for r in full.post("/v1/completions/render", json=completion).json()]
    tokens = httpx.post(url + "/tokenize", json={"model": "tiny", "prompt": "Hello there"}, timeout=30).json()
    assert tokens == full.post("/tokenize", json={"model": "tiny", "prompt": "Hello there"}).json()


def test_derenders_what_the_full_server_generated(render_server: RemoteServer, full: Any) -> None:
    """Render and derender on the render-only server, generate on the full one: the coupled reply."""
    chat = {"model": "tiny", "messages": ASK, "max_tokens": 9, "temperature": 0.0}
    coupled = full.post("/v1/chat/completions", json=chat).json()["choices"][0]
    rendered = httpx.post(render_server.url + "/v1/chat/completions/render", json=chat, timeout=30).json()
    generated = full.post("/inference/v1/generate", json=rendered).json()
    r = httpx.post(render_server.url + "/v1/chat/completions/derender", json={
        "model": "tiny", "generate_response": generated, "chat_request": chat}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == coupled["message"]["content"]
    assert r.json()["choices"][0]["finish_reason"] == coupled["finish_reason"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/inference/v1/generate",
                                  "/v1/embeddings", "/v1/responses", "/v1/messages"])
def test_generation_routes_are_absent(render_server: RemoteServer, path: str) -> None:
    r = httpx.post(render_server.url + path, json={"model": "tiny", "prompt": "x", "messages": ASK}, timeout=30)
    assert r.status_code == 404, r.text


def test_responses_render(render_server: RemoteServer, full: Any) -> None:
    """A Responses request's generate request: the chat render of the same conversation, a resp_ id, its
    max_output_tokens as max_tokens; what would read a stored response is a 400 naming it."""
    url = render_server.url
    body = {"model": "tiny", "input": "Name three colors.", "max_output_tokens": 7}
    r = httpx.post(url + "/v1/responses/render", json=body, timeout=30)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["request_id"].startswith("resp_") and got["sampling_params"]["max_tokens"] == 7
    chat = full.post("/v1/chat/completions/render", json={"model": "tiny", "messages": ASK}).json()
    assert got["token_ids"] == chat["token_ids"]
    for field, value in (("previous_response_id", "resp_x"), ("background", True)):
        r = httpx.post(url + "/v1/responses/render", json={**body, field: value}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_reply_ids_are_the_clients(render_server: RemoteServer, full: Any) -> None:
    """vLLM's ids: a request's request_id (an X-Request-Id header wins) names the reply, rendered or run; the
    engine's own ids stay the server's (two equal ids run side by side)."""
    url = render_server.url
    chat = {"model": "tiny", "messages": ASK, "max_tokens": 3, "request_id": "abc"}
    assert httpx.post(url + "/v1/chat/completions/render", json=chat, timeout=30).json()["request_id"] == \
        "chatcmpl-abc"
    r = httpx.post(url + "/v1/chat/completions/render", json=chat, headers={"X-Request-Id": "hdr"}, timeout=30)
    assert r.json()["request_id"] == "chatcmpl-hdr"
    prompts = {"model": "tiny", "prompt": ["a", "b"], "max_tokens": 3, "request_id": "abc"}
    assert [g["request_id"] for g in httpx.post(url + "/v1/completions/render", json=prompts, timeout=30).json()] \
        == ["cmpl-abc-0", "cmpl-abc-1"]
    assert full.post("/v1/chat/completions", json=chat).json()["id"] == "chatcmpl-abc"
    assert full.post("/v1/completions", json=prompts).json()["id"] == "cmpl-abc"
    rendered = httpx.post(url + "/v1/chat/completions/render", json={"model": "tiny", "messages": ASK}, timeout=30)
    assert "return_tokens_as_token_ids" not in rendered.json()["parse_context"]  # (null: left out, as vLLM)


def test_derender_passes_prompt_logprobs_and_transfer_params_through(render_server: RemoteServer) -> None:
    """A generate reply's prompt_logprobs (a null decoded_token decoded; an id outside the vocabulary: "") and
    kv_transfer_params come back with the derendered reply; logprobs may cover the first tokens only."""
    reply = {"choices": [{"token_ids": [400, 401, 402], "finish_reason": "length",
                          "logprobs": {"content": [{"token_id": 400, "logprob": -0.5}]}}],
             "prompt_logprobs": [None, {"400": {"logprob": -1.0, "rank": 2}}, {"9999999": {"logprob": -2.0}}],
             "kv_transfer_params": {"key": "value"}}
    r = httpx.post(render_server.url + "/v1/chat/completions/derender", json={"model": "tiny",
                                                                               "generate_response": reply}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["kv_transfer_params"] == {"key": "value"}
    assert body["prompt_logprobs"][0] is None and body["prompt_logprobs"][2]["9999999"]["decoded_token"] == ""
    assert body["prompt_logprobs"][1]["400"]["decoded_token"]
    assert len(body["choices"][0]["logprobs"]["content"]) == 1


def test_render_token_offsets(render_server: RemoteServer, full: Any) -> None:
    """return_token_offsets (vLLM's): each prompt token's [start, end) in the prompt's text, cut with the tokens by
    truncate_prompt_tokens; null without it; a 400 naming it on the routes that run a request."""
    url = render_server.url
    text = "The quick brown fox jumps over the lazy dog."
    body = {"model": "tiny", "prompt": [text, "Hello, world."], "return_token_offsets": True}
    for got, prompt in zip(httpx.post(url + "/v1/completions/render", json=body, timeout=30).json(), body["prompt"]):
        spans = got["token_offsets"]
        assert len(spans) == len(got["token_ids"]) and spans[-1][1] == len(prompt)
        assert all(0 <= a <= b <= len(prompt) for a, b in spans)
    cut = httpx.post(url + "/v1/completions/render", json={**body, "prompt": text, "truncate_prompt_tokens": 4,
                                                            "truncation_side": "left"}, timeout=30).json()[0]
    assert len(cut["token_ids"]) == len(cut["token_offsets"]) == 4
    assert cut["token_offsets"][-1][1] == len(text) and cut["token_offsets"][0][0] > 0
    chat = httpx.post(url + "/v1/chat/completions/render", json={"model": "tiny", "messages": ASK,
                                                                 "return_token_offsets": True}, timeout=30).json()
    assert len(chat["token_offsets"]) == len(chat["token_ids"])
    plain = httpx.post(url + "/v1/chat/completions/render", json={"model": "tiny", "messages": ASK}, timeout=30)
    assert plain.json()["token_offsets"] is None
    for path, extra in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": text})):
        r = full.post(path, json={"model": "tiny", "max_tokens": 2, "return_token_offsets": True, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "return_token_offsets", r.text


def test_messages_render_merges_inline_system_messages(render_server: RemoteServer) -> None:
    """A "system" message inside Messages' messages (vLLM's extension) joins the system prompt: the same prompt as
    the request with it merged by hand."""
    url, turns = render_server.url, [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"}]
    inline = httpx.post(url + "/v1/messages/render", json={
        "model": "tiny", "max_tokens": 8, "system": "Be kind.",
        "messages": [*turns, {"role": "system", "content": [{"type": "text", "text": " Be brief."}]},
                     {"role": "user", "content": "2 + 2?"}]}, timeout=30)
    merged = httpx.post(url + "/v1/messages/render", json={
        "model": "tiny", "max_tokens": 8, "system": "Be kind. Be brief.",
        "messages": [*turns, {"role": "user", "content": "2 + 2?"}]}, timeout=30)
    assert inline.status_code == 200, inline.text
    assert inline.json()["token_ids"] == merged.json()["token_ids"]


def test_flags_a_render_server_cannot_serve_are_refused(tiny_llm_dir: Path) -> None:
    """What needs an engine or a generation route is refused at start-up naming the flag, never dropped."""
    import subprocess
    import sys

    for flag in ("--enable-server-load-tracking", "--allow-runtime-lora-updating"):
        done = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "launch", "render", str(tiny_llm_dir),
                               flag], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and flag in done.stderr and "render-only" in done.stderr, done.stderr
