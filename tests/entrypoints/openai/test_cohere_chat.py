"""vLLM 0.34's server features against a real server: Cohere's Chat v2 API (/cohere/v2/chat, /cohere/v2/chat/render),
--enable-per-request-metrics and --watermark-config. Each v2 reply is held to the chat completion of the same
conversation (both run one request path), the stream to Cohere's event lifecycle, the render to /tokenize, and
errors to Cohere's {"message"} shape naming the field; a watermarked server repeats its sampled replies (the key, not
a seed, decides them). The watermark's tokens themselves: tests/engine/test_watermark.py."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.utils import RemoteServer

MODEL = "tiny"
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi!"}]}]
CHAT_ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
TIMING = {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second"}


@pytest.fixture(scope="module")
def cohere_server(tiny_llm_dir: Path) -> Iterator[RemoteServer]:
    srv = RemoteServer(tiny_llm_dir, "--served-model-name", MODEL, "--no-cohere-is-reasoning-model",
                       "--enable-scale-out", "--enable-per-request-metrics",
                       "--watermark-config", '{"algorithm": "gumbel", "key": 42}')
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(cohere_server: RemoteServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cohere_server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def oai(cohere_server: RemoteServer) -> openai.OpenAI:
    return cohere_server.get_client()


def test_chat_is_the_chat_completion(http: httpx.Client, oai: openai.OpenAI) -> None:
    r = http.post("/cohere/v2/chat", json={"model": MODEL, "messages": ASK, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    chat = oai.chat.completions.create(model=MODEL, messages=CHAT_ASK, max_completion_tokens=8, temperature=0)
    assert body["message"] == {"role": "assistant",
                               "content": [{"type": "text", "text": chat.choices[0].message.content}]}
    assert body["finish_reason"] == {"length": "MAX_TOKENS", "stop": "COMPLETE"}[chat.choices[0].finish_reason]
    counts = {"input_tokens": chat.usage.prompt_tokens, "output_tokens": chat.usage.completion_tokens}
    assert body["usage"]["billed_units"] == counts and body["usage"]["tokens"] == counts
    assert body["id"] and "logprobs" not in body


def test_stop_sequence_and_logprobs(http: httpx.Client) -> None:
    base = {"model": MODEL, "messages": ASK, "max_tokens": 12, "temperature": 0}
    whole = http.post("/cohere/v2/chat", json=base).json()["message"]["content"][0]["text"]
    stop = whole[len(whole) // 2:len(whole) // 2 + 2]
    assert stop.strip(), whole
    body = http.post("/cohere/v2/chat", json={**base, "stop_sequences": [stop], "logprobs": True}).json()
    assert body["finish_reason"] == "STOP_SEQUENCE"
    assert body["logprobs"] and all(len(item["token_ids"]) == 1 and item["logprobs"][0] <= 0
                                    for item in body["logprobs"])


def test_stream_lifecycle(http: httpx.Client) -> None:
    req = {"model": MODEL, "messages": ASK, "max_tokens": 8, "temperature": 0}
    whole = http.post("/cohere/v2/chat", json=req).json()
    with http.stream("POST", "/cohere/v2/chat", json={**req, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        frames = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    events = [json.loads(f) for f in frames[:-1]]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message-start" and events[0]["id"] and kinds[-1] == "message-end"
    assert kinds[1] == "content-start" and kinds[-2] == "content-end" and set(kinds[2:-2]) == {"content-delta"}
    text = "".join(e["delta"]["message"]["content"]["text"] for e in events if e["type"] == "content-delta")
    assert text == whole["message"]["content"][0]["text"]
    assert events[-1]["delta"]["finish_reason"] == whole["finish_reason"]
    assert events[-1]["delta"]["usage"]["tokens"] == whole["usage"]["tokens"]


def test_render_is_the_prompt(http: httpx.Client) -> None:
    r = http.post("/cohere/v2/chat/render", json={"model": MODEL, "messages": ASK, "max_tokens": 8,
                                                   "temperature": 0.125, "p": 0.5, "k": 3, "stop_sequences": ["END"]})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = http.post("/tokenize", json={"model": MODEL, "messages": CHAT_ASK}).json()["tokens"]
    assert body["token_ids"] == ids and body["request_id"] and "message" not in body
    params = body["sampling_params"]
    assert (params["temperature"], params["top_p"], params["top_k"], params["stop"], params["max_tokens"]) == \
        (0.125, 0.5, 3, ["END"], 8)


@pytest.mark.parametrize("body, named", [
    ({"messages": ASK}, "model"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": ASK, "frobnicate": 1}, "frobnicate"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0]"),
    ({"model": MODEL, "messages": ASK, "priority": 3}, "priority"),
    ({"model": MODEL, "messages": ASK, "tool_choice": "REQUIRED"}, "tool_choice"),
    ({"model": MODEL, "messages": ASK, "p": 2.0}, "p"),
])
def test_errors_in_cohere_shape(http: httpx.Client, body: dict, named: str) -> None:
    for path in ("/cohere/v2/chat", "/cohere/v2/chat/render"):
        r = http.post(path, json=body)
        assert r.status_code == 400, r.text
        error = r.json()
        assert "error" not in error and named in error["message"], error


def test_per_request_metrics(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(model=MODEL, messages=CHAT_ASK, max_completion_tokens=4, temperature=0,
                                    extra_body={"min_tokens": 4})
    metrics = r.model_extra["metrics"]
    assert set(metrics) == TIMING and all(v >= 0 for v in metrics.values())
    chunks = list(oai.chat.completions.create(model=MODEL, messages=CHAT_ASK, max_completion_tokens=1,
                                              temperature=0, stream=True, stream_options={"include_usage": True}))
    assert all("metrics" not in (c.model_extra or {}) for c in chunks[:-1])
    assert set(chunks[-1].model_extra["metrics"]) == TIMING - {"mean_itl_ms"}  # one token: no inter-token latency
    two = oai.chat.completions.create(model=MODEL, messages=CHAT_ASK, max_completion_tokens=2, n=2)
    assert "metrics" not in two.model_extra  # n > 1: the timing is not each choice's
    done = oai.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0, extra_body={"min_tokens": 3})
    assert set(done.model_extra["metrics"]) == TIMING
    both = oai.completions.create(model=MODEL, prompt=["Hi", "Yo"], max_tokens=2)
    assert "metrics" not in both.model_extra  # two prompts: two requests' timings
    *_, last = oai.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stream=True,
                                      stream_options={"include_usage": True})
    assert last.usage is not None and set(last.model_extra["metrics"]) == TIMING


def test_watermarked_replies_repeat(oai: openai.OpenAI, http: httpx.Client) -> None:
    def reply(**extra: object) -> str:
        return oai.chat.completions.create(model=MODEL, messages=CHAT_ASK, max_completion_tokens=12, temperature=1,
                                           extra_body=extra or None).choices[0].message.content
    assert reply() == reply() == reply(watermarking=True)
    cohere = http.post("/cohere/v2/chat", json={"model": MODEL, "messages": ASK, "max_tokens": 12, "temperature": 1})
    assert cohere.json()["message"]["content"][0]["text"] == reply()
    assert len({reply(watermarking=False) for _ in range(3)}) > 1  # opted out: random draws


def test_off_by_default(server: RemoteServer) -> None:
    """Without the flags: no render route (404, Cohere's shape), no metrics; /cohere/v2/chat is always served."""
    r = httpx.post(f"{server.url}/cohere/v2/chat/render", json={"model": "tiny", "messages": ASK})
    assert r.status_code == 404 and "message" in r.json()
    chat = server.get_client().chat.completions.create(model="tiny", messages=CHAT_ASK, max_completion_tokens=2)
    assert "metrics" not in chat.model_extra
    r = httpx.post(f"{server.url}/cohere/v2/chat", json={"model": "tiny", "messages": ASK, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["message"]["content"][0]["type"] == "text"
    with pytest.raises(openai.BadRequestError, match="watermark"):  # nothing to apply: refused, not ignored
        server.get_client().chat.completions.create(model="tiny", messages=CHAT_ASK, extra_body={"watermarking": True})
