"""Right shape everywhere (issue 43, point 7), against a real `pagedllm serve`: logprobs of tokens a structured
output rules out are finite (-9999.0, as vLLM), never a 500 or a null in a stream; the edge's 413, 408 and 503
and the shutdown's stream endings in Anthropic's and the Responses API's own shapes; reasoning items, thinking
blocks and content parts checked strictly; booleans are not token ids; no client id echoed whole; the Responses
API's context-length error names input."""
from __future__ import annotations

import json
import math
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.utils import RemoteServer

MODEL = "tiny"
CHOICE = {"choice": ["yes", "no"]}
ASK = {"role": "user", "content": "Pick:"}


def _strict_json(text: str) -> Any:
    """JSON with no -Infinity, Infinity or NaN (Python's json takes them; no other parser does)."""
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in {text[:300]}")
    return json.loads(text, parse_constant=refuse)


def _finite(values: list[Any]) -> bool:
    return bool(values) and all(isinstance(v, float) and math.isfinite(v) for v in values)


def _events(text: str) -> list[Any]:
    return [_strict_json(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


# ------------------------------------------------------------------------------ logprobs with structured outputs


def test_completion_logprobs_with_a_structured_output_are_finite(server: RemoteServer) -> None:
    body = {"model": MODEL, "prompt": "Pick:", "max_tokens": 3, "logprobs": 20, "prompt_logprobs": 5,
            "structured_outputs": CHOICE, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = _strict_json(r.text)["choices"][0]
    assert choice["text"] in ("yes", "no")
    lp = choice["logprobs"]
    tops = [v for top in lp["top_logprobs"] for v in top.values()]
    assert _finite(lp["token_logprobs"]) and _finite(tops)
    assert -9999.0 in tops  # the ruled-out alternatives, as vLLM reports them
    assert _finite([e["logprob"] for entry in choice["prompt_logprobs"][1:] for e in entry.values()])
    body.pop("prompt_logprobs")
    streamed = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60)
    chunks = [c["choices"][0]["logprobs"] for c in _events(streamed.text) if c["choices"]]
    assert _finite([v for c in chunks for v in c["token_logprobs"]])
    assert _finite([v for c in chunks for top in c["top_logprobs"] for v in top.values()])


@pytest.mark.parametrize("constraint", [{"structured_outputs": CHOICE},
                                        {"response_format": {"type": "json_object"}}])
def test_chat_logprobs_with_a_structured_output_are_finite(server: RemoteServer, constraint: dict) -> None:
    body = {"model": MODEL, "messages": [ASK], "max_tokens": 4, "logprobs": True, "top_logprobs": 20,
            "temperature": 0, **constraint}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    content = _strict_json(r.text)["choices"][0]["logprobs"]["content"]
    assert _finite([t["logprob"] for t in content])
    tops = [t["logprob"] for token in content for t in token["top_logprobs"]]
    assert _finite(tops) and -9999.0 in tops
    streamed = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60)
    tokens = [t for c in _events(streamed.text) if c["choices"] and c["choices"][0]["logprobs"]
              for t in c["choices"][0]["logprobs"]["content"]]
    assert _finite([t["logprob"] for t in tokens])
    assert _finite([t["logprob"] for token in tokens for t in token["top_logprobs"]])


# ------------------------------------------------------------------------------ the edge's errors, per API


@pytest.fixture(scope="module")
def edge(tiny_llm_dir: Path) -> Iterator[RemoteServer]:
    srv = RemoteServer(tiny_llm_dir, "--served-model-name", MODEL, "--max-body-bytes", "100000",
                       "--body-timeout", "1")
    yield srv
    srv.stop()


def _anthropic_error(r: httpx.Response, kind: str) -> None:
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"], r.text
    assert "param" not in body["error"]


def test_the_edges_413_and_408_take_each_apis_shape(edge: RemoteServer) -> None:
    big = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x" * 200_000}]}
    r = httpx.post(f"{edge.url}/v1/messages", json=big, timeout=30)
    assert r.status_code == 413
    _anthropic_error(r, "request_too_large")
    r = httpx.post(f"{edge.url}/v1/responses", json={"model": MODEL, "input": "x" * 200_000}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    # a body that stops arriving: 408 at --body-timeout
    with socket.create_connection(("127.0.0.1", edge.port), timeout=10) as s:
        s.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 100\r\n\r\n{\"model\":")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            piece = s.recv(65536)
            if not piece:
                break
            reply += piece
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply
    _anthropic_error(httpx.Response(408, content=payload), "timeout_error")


def test_the_shutdowns_stream_endings_take_each_apis_shape(tiny_llm_dir: Path) -> None:
    """Streams still running past --shutdown-timeout end in their API's error event: Anthropic's on /v1/messages,
    the Responses API's (numbered after the last event) on /v1/responses; neither with OpenAI's [DONE]. One
    sequence at a time behind a long completion, so both are still running when the grace period ends."""
    srv = RemoteServer(tiny_llm_dir, "--served-model-name", MODEL, "--shutdown-timeout", "1", "--max-num-seqs", "1")
    texts: dict[str, str] = {}
    started = {path: threading.Event() for path in ("/v1/messages", "/v1/responses")}
    bodies = {"/v1/messages": {"model": MODEL, "max_tokens": 400, "stream": True, "messages": [ASK]},
              "/v1/responses": {"model": MODEL, "max_output_tokens": 400, "stream": True, "input": "Go on."}}

    def stream(path: str) -> None:
        text = ""
        try:
            with httpx.stream("POST", f"{srv.url}{path}", json=bodies[path], timeout=60) as r:
                for line in r.iter_lines():
                    started[path].set()
                    text += line + "\n"
        except httpx.HTTPError:
            pass
        texts[path] = text

    try:
        hog = {"model": MODEL, "prompt": "Go", "max_tokens": 480, "ignore_eos": True, "stream": True}
        # 16 x 480 tokens queued ahead, one sequence at a time: seconds of work even where the tiny model makes
        # thousands of tokens a second (3 of them, and both streams, could finish within the 1 s grace period)
        hogs = [threading.Thread(target=lambda: httpx.post(f"{srv.url}/v1/completions", json=hog, timeout=60),
                                 daemon=True) for _ in range(16)]
        for t in hogs:
            t.start()
        time.sleep(0.5)
        threads = [threading.Thread(target=stream, args=(path,), daemon=True) for path in bodies]
        for t in threads:
            t.start()
        assert all(e.wait(30) for e in started.values())
        srv.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert srv.proc.wait(timeout=30) == 0
    finally:
        srv.stop()
    messages = texts["/v1/messages"].strip().split("\n")
    assert messages[-2] == "event: error" and "[DONE]" not in texts["/v1/messages"], messages[-4:]
    error = _strict_json(messages[-1].removeprefix("data: "))
    assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
    assert "shutting down" in error["error"]["message"]
    events = _events(texts["/v1/responses"])
    assert "[DONE]" not in texts["/v1/responses"] and events[-1]["type"] == "error", events[-2:]
    assert events[-1]["code"] == "server_shutdown" and events[-1]["message"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


# ------------------------------------------------------------------------------ strict input items and blocks


@pytest.mark.parametrize("item, param", [
    ({"type": "reasoning", "id": "rs_1", "summary": [], "colour": 1}, "input[0].colour"),
    ({"type": "reasoning", "id": "rs_1", "summary": "thought"}, "input[0].summary"),
    ({"type": "reasoning", "id": "rs_1", "summary": [{"type": "output_text", "text": "t"}]}, "input[0].summary[0]"),
    ({"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": 5}]},
     "input[0].summary[0].text"),
    ({"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "t",
                                                                    "x": 1}]}, "input[0].content[0].x"),
    ({"type": "reasoning", "id": 7, "summary": []}, "input[0].id"),
    ({"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": 5}, "input[0].encrypted_content"),
    ({"type": "reasoning", "id": "rs_1", "summary": [], "status": "thinking"}, "input[0].status"),
    ({"role": "user", "content": [{"type": "input_text", "text": "hi", "colour": 1}]}, "input[0].content[0].colour"),
    ({"role": "user", "content": [{"type": "output_text", "text": "hi", "annotations": "none"}]},
     "input[0].content[0].annotations"),
    ({"role": "user", "content": "hi", "status": "sent"}, "input[0].status"),
])
def test_responses_input_items_are_checked_strictly(server: RemoteServer, item: dict, param: str) -> None:
    r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": [item, ASK]}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_our_own_reasoning_item_is_taken_back(server: RemoteServer) -> None:
    item = {"id": "rs_1", "type": "reasoning", "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": "Let me think."}], "encrypted_content": None}
    r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": [ASK, item, ASK],
                                                        "max_output_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("block, field", [
    ({"type": "thinking", "thinking": "hmm", "signature": "", "colour": 1}, "messages[1].content[0].colour"),
    ({"type": "thinking", "thinking": 5, "signature": ""}, "messages[1].content[0].thinking"),
    ({"type": "thinking", "thinking": "hmm"}, "messages[1].content[0].signature"),
    ({"type": "redacted_thinking"}, "messages[1].content[0].data"),
    ({"type": "redacted_thinking", "data": "x", "thinking": "y"}, "messages[1].content[0].thinking"),
])
def test_thinking_blocks_are_checked_strictly(server: RemoteServer, block: dict, field: str) -> None:
    body = {"model": MODEL, "max_tokens": 2,
            "messages": [ASK, {"role": "assistant", "content": [block, {"type": "text", "text": "yes"}]}, ASK]}
    r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=30)
    assert r.status_code == 400, r.text
    _anthropic_error(r, "invalid_request_error")
    assert field in r.json()["error"]["message"], r.text
    good = {"type": "thinking", "thinking": "hmm", "signature": ""}  # as our replies carry it
    body["messages"][1]["content"][0] = good
    assert httpx.post(f"{server.url}/v1/messages", json=body, timeout=30).status_code == 200


# ------------------------------------------------------------------------------ token ids, echoed ids, input


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": [True]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, True]]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [True]}, "stop_token_ids[0]"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [False, 5]}, "allowed_token_ids[0]"),
    ("/v1/chat/completions", {"messages": [ASK], "stop_token_ids": [True]}, "stop_token_ids[0]"),
    ("/detokenize", {"tokens": [True]}, "tokens[0]"),
    ("/v1/embeddings", {"input": [True]}, "input"),
])
def test_a_boolean_is_not_a_token_id(server: RemoteServer, path: str, body: dict, param: str) -> None:
    r = httpx.post(f"{server.url}{path}", json={"model": MODEL, "max_tokens": 1, **body} if path.startswith("/v1/c")
                   else {"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_a_megabyte_id_is_not_echoed_back(server: RemoteServer) -> None:
    long = "m" * 1_000_000
    replies = [httpx.post(f"{server.url}/v1/completions", json={"model": long, "prompt": "hi"}, timeout=30),
               httpx.post(f"{server.url}/v1/messages", json={"model": long, "max_tokens": 1, "messages": [ASK]},
                          timeout=30),
               httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "hi",
                                                             "previous_response_id": long}, timeout=30),
               httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": [{"type": long}]},
                          timeout=30),
               httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "hi",
                                                             "text": {"format": {"type": "text", long: 1}}},
                          timeout=30),
               httpx.get(f"{server.url}/v1/responses/resp_{'r' * 8000}", timeout=30)]
    assert [r.status_code for r in replies] == [404, 404, 400, 400, 400, 404], [r.text[:200] for r in replies]
    for r in replies:
        assert len(r.content) < 1000, r.text[:300]
    assert "mmm..." in replies[0].json()["error"]["message"]


def test_the_responses_context_length_error_names_input(server: RemoteServer) -> None:
    r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "word " * 800,
                                                        "max_output_tokens": 4}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input" and error["message"].startswith("input "), r.text
