"""What a client sends never holds a real `pagedllm serve`'s event loop in proportion to its size, and one
request's bounds multiplied together are bounded: a body of millions of tiny JSON values is a 400 (--max-json-values)
while /health keeps answering, text in tool_calls counts in --max-prompt-bytes, and a request whose prompts x n x
max_tokens (x logprobs, unless streamed) pass --max-request-tokens is refused at once."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagedllm.entrypoints.openai.json_scan import json_shape
from pagedllm.entrypoints.openai.limits import ServingLimits, check_request_tokens
from pagedllm.errors import ValidationError
from tests.utils import RemoteServer, with_context

C, CHAT = "/v1/completions", "/v1/chat/completions"
HEALTHY_WITHIN = 0.5
"""Seconds /health may take while the server refuses or serves a large body."""


@pytest.fixture(scope="module")
def srv(tiny_llm_dir: Path) -> Iterator[RemoteServer]:
    s = RemoteServer(tiny_llm_dir, "--max-model-len", "512", "--max-prompt-bytes", "2000")
    yield s
    s.stop()


class HealthPoller:
    """Polls /health from a thread until stopped; every answer's latency (a timeout counts as its limit)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                try:
                    ok = client.get(f"{self.url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies.append(time.monotonic() - start)
                self.failures += not ok
                time.sleep(0.02)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.2)
        self._stop.set()
        self._thread.join()


def _tiny_values_body(count: int) -> bytes:
    """A legal-size chat body of ``count`` empty arrays inside an assistant message's tool_calls (~3 bytes each)."""
    return (b'{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"x","tool_calls":['
            + b"[]," * (count - 1) + b'[]]}],"max_tokens":1}')


def test_a_body_of_millions_of_tiny_values_is_a_400_while_health_answers(srv: RemoteServer) -> None:
    body = _tiny_values_body(5_000_000)  # ~14 MiB, under the default --max-body-bytes (16 MiB)
    assert json_shape(body)[0] > 2**18
    with HealthPoller(srv.url) as poller, httpx.Client(timeout=60) as client:
        start = time.monotonic()
        r = client.post(f"{srv.url}{CHAT}", content=body, headers={"content-type": "application/json"})
        took = time.monotonic() - start
    print(f"refused in {took:.2f} s; /health at most {max(poller.latencies):.3f} s over {len(poller.latencies)} polls")
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages" and "--max-json-values" in error["message"], error
    assert took < 10
    assert poller.failures == 0 and len(poller.latencies) >= 5
    assert max(poller.latencies) < HEALTHY_WITHIN, sorted(poller.latencies)[-5:]
    assert client_ok(srv)


def test_a_body_nested_too_deep_is_a_400_naming_the_field(srv: RemoteServer) -> None:
    body = b'{"prompt":"hi","max_tokens":1,"logit_bias":' + b"[" * 200 + b"]" * 200 + b"}"
    r = httpx.post(f"{srv.url}{C}", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "logit_bias" and "--max-json-depth" in r.json()["error"]["message"]


def test_a_long_text_with_many_commas_and_brackets_inside_strings_is_not_counted(srv: RemoteServer) -> None:
    """The bound counts values, not bytes that look like them inside strings: 1M commas in a prompt pass it (and
    meet the prompt's own byte cap instead)."""
    r = httpx.post(f"{srv.url}{C}", json={"prompt": "[a],\\\"{" * 300_000, "max_tokens": 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "--max-json-values" not in r.json()["error"]["message"]


def test_tool_calls_count_in_the_prompt_bytes(srv: RemoteServer) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": \"" + "z" * 3000 + "\"}"}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    r = httpx.post(f"{srv.url}{CHAT}", json={"messages": messages, "max_tokens": 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def client_ok(srv: RemoteServer) -> bool:
    r = httpx.post(f"{srv.url}{C}", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# ------------------------------------------------------------------------------------------ the product of bounds


@pytest.fixture(scope="module")
def product_srv(tiny_llm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    """The default --max-request-tokens, on the tiny model with an 8192-token context and n wide enough for the
    issue's request."""
    folder = with_context(tiny_llm_dir, tmp_path_factory.mktemp("context-8k"), 8192)
    s = RemoteServer(folder, "--max-model-len", "8192", "--max-n", "256", "--num-kv-blocks", "64")
    yield s
    s.stop()


OVER_PRODUCT = {"prompt": ["a", "b", "c", "d"], "n": 256, "max_tokens": 8000, "ignore_eos": True, "logprobs": 20}
"""4 x 256 x 8000: 8.2M tokens to generate, 172M log-probabilities to hold."""


@pytest.mark.parametrize("path, body, param", [
    (C, OVER_PRODUCT, "max_tokens"),
    (C, {**OVER_PRODUCT, "stream": True}, "max_tokens"),  # streamed: the tokens to generate are bounded too
    (C, {**OVER_PRODUCT, "n": 16}, "logprobs"),  # 512k tokens: fine; x21 log-probabilities held: not
    (C, {**OVER_PRODUCT, "max_tokens": None, "n": 200, "logprobs": None}, "max_tokens"),  # filled to the context
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "n": 200, "logprobs": True, "top_logprobs": 20},
     "max_tokens"),  # chat's omitted max_tokens fills the context: 200 x ~8180
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "n": 64, "max_completion_tokens": 8000,
            "logprobs": True, "top_logprobs": 5}, "top_logprobs"),
])
def test_a_request_over_the_product_of_bounds_is_refused_at_once(product_srv: RemoteServer, path: str, body: dict,
                                                                 param: str) -> None:
    start = time.monotonic()
    r = httpx.post(f"{product_srv.url}{path}", json=body, timeout=30)
    assert time.monotonic() - start < 5.0  # at once: nothing is generated (well under this on a loaded CI machine)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "--max-request-tokens" in error["message"], error
    assert product_srv.wait_idle() < 1  # nothing was queued


def test_the_same_request_within_the_product_is_served(product_srv: RemoteServer) -> None:
    body = {**OVER_PRODUCT, "n": 2, "max_tokens": 4}
    r = httpx.post(f"{product_srv.url}{C}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 8 and r.json()["usage"]["completion_tokens"] == 32
    streamed = {**OVER_PRODUCT, "n": 16, "max_tokens": 4, "stream": True}  # 64k entries held if not streamed: fine
    with httpx.stream("POST", f"{product_srv.url}{C}", json=streamed, timeout=60) as s:
        assert s.status_code == 200
        assert list(s.iter_lines())[-2] == "data: [DONE]"


def test_one_sample_filling_a_long_context_with_the_most_logprobs_is_within_the_default() -> None:
    """An ordinary request on a 128k-context model (no max_tokens, top_logprobs 20, not streamed) is what vLLM
    serves: the default bound grows with the context; 16 such samples are over it."""
    limits = ServingLimits()
    check_request_tokens(limits, 131072, [131072 - 10], 1, False, 20)
    with pytest.raises(ValidationError) as e:
        check_request_tokens(limits, 131072, [131072 - 10], 16, False, 20)
    assert e.value.param == "logprobs"
    check_request_tokens(ServingLimits(max_request_tokens=10), 8192, [5], 2, True)  # a set bound is kept as set
    with pytest.raises(ValidationError):
        check_request_tokens(ServingLimits(max_request_tokens=10), 131072, [6], 2, True)
