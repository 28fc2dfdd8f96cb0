"""The streamed derender routes (issue 45): /v1/chat/completions/derender and /v1/completions/derender with stream:
true, one generate chunk a call with the stream_state the last call answered, give what the coupled route streams
for the same tokens, whatever the chunking (per token, by threes, whole); on a server with a reasoning and a tool
parser, reasoning, content and tool calls as the non-streamed derender parses them; logprobs by token id decoded as
the coupled route decodes them; a bad or stale stream_state is a 400 naming it. /inference/v1/generate's streamed
output_mode "derender" on that server streams what the chat route streams. stream_interval (request and
--stream-interval) gathers a stream's tokens into chunks of that many."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.utils import thread_engine

GENERATE = "/inference/v1/generate"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _app(tiny_llm_dir: Any, **options: Any) -> Any:
    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.entrypoints.openai.metrics import ServerMetrics

    return build_app(thread_engine(tiny_llm_dir), ServerMetrics("t"), ["t"], [], enable_scale_out=True, **options)


@pytest.fixture(scope="module")
def plain(tiny_llm_dir: Any) -> Iterator[Any]:
    """A server without parsers."""
    from fastapi.testclient import TestClient

    with TestClient(_app(tiny_llm_dir)) as http:
        yield http


@pytest.fixture(scope="module")
def parsed(tiny_llm_dir: Any) -> Iterator[Any]:
    """A server with deepseek_r1's reasoning parser, hermes' tool parser and --stream-interval 2."""
    from fastapi.testclient import TestClient

    with TestClient(_app(tiny_llm_dir, reasoning_parser="deepseek_r1", tool_call_parser="hermes",
                         stream_interval=2)) as http:
        yield http


def _events(http: Any, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line[6:] != "[DONE]"]


def _assemble(choices: list[dict]) -> dict:
    """Streamed chat choices folded into one message (vLLM's test helper's way)."""
    content, reasoning, calls, finish = "", "", [], None
    for choice in choices:
        delta = choice["delta"]
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning") or ""
        for call in delta.get("tool_calls") or []:
            calls.append((call["function"]["name"], json.loads(call["function"]["arguments"])))
        finish = choice.get("finish_reason") or finish
    return {"content": content or None, "reasoning": reasoning or None, "tool_calls": calls, "finish_reason": finish}


def _derender(http: Any, path: str, ids: list[int], sizes: list[int], finish: str, extra: dict) -> list[dict]:
    """``ids`` through the streamed derender in chunks of ``sizes``, the state carried; every chunk's choices."""
    state, choices, at = None, [], 0
    for i, size in enumerate(sizes):
        piece, at = ids[at:at + size], at + size
        last = i == len(sizes) - 1
        r = http.post(path, json={"stream": True, "model": "t", "stream_state": state, **extra, "generate_chunk": {
            "request_id": "s", "choices": [{"index": 0, "token_ids": piece,
                                            "finish_reason": finish if last else None}]}})
        assert r.status_code == 200, r.text
        state = r.json()["stream_state"]
        choices += r.json()["chunk"]["choices"]
    return choices


def _sizes(n: int, chunking: str) -> list[int]:
    return {"whole": [n], "per_token": [1] * n, "threes": [3] * (n // 3) + ([n % 3] if n % 3 else [])}[chunking]


@pytest.mark.parametrize("chunking", ["whole", "per_token", "threes"])
def test_streamed_chat_derender_is_the_coupled_stream(plain: Any, chunking: str) -> None:
    """A generate stream's tokens, derendered chunk by chunk, assemble to the coupled stream's message, one role,
    each chunk's own token ids; a stop string the reply ends on is cut as the coupled route cuts it."""
    body = {"model": "t", "messages": ASK, "max_tokens": 14, "temperature": 0.0, "return_token_ids": True}
    words = plain.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"].split()
    assert len(words) > 3
    for extra in ({}, {"stop": [words[3]]}):
        request = {**body, **extra}
        coupled = [c for e in _events(plain, "/v1/chat/completions", {**request, "stream": True}) for c in e["choices"]]
        rendered = plain.post("/v1/chat/completions/render", json=request).json()
        tokens = plain.post(GENERATE, json=rendered).json()["choices"][0]
        ids = tokens["token_ids"]
        assert ids == [t for c in coupled for t in c.get("token_ids") or []]
        got = _derender(plain, "/v1/chat/completions/derender", ids, _sizes(len(ids), chunking),
                        tokens["finish_reason"], {"chat_request": request, "prompt_token_ids": rendered["token_ids"]})
        assert _assemble(got) == _assemble(coupled), extra
        assert [c["delta"].get("role") for c in got].count("assistant") == 1
        assert [t for c in got for t in c["token_ids"]] == ids


def test_streamed_completion_derender_with_logprobs(plain: Any) -> None:
    """Completions: the streamed derender's text and logprobs (tokens, top candidates, absolute text offsets) are
    the coupled stream's."""
    body = {"model": "t", "prompt": "The capital of France", "max_tokens": 8, "temperature": 0.0, "logprobs": 2}
    coupled = [c for e in _events(plain, "/v1/completions", {**body, "stream": True}) for c in e["choices"]]
    rendered = plain.post("/v1/completions/render", json=body).json()[0]
    tokens = plain.post(GENERATE, json=rendered).json()["choices"][0]
    ids, content = tokens["token_ids"], tokens["logprobs"]["content"]
    state, got = None, []
    for i in range(len(ids)):
        r = plain.post("/v1/completions/derender", json={
            "stream": True, "model": "t", "stream_state": state, "completion_request": body,
            "prompt_token_ids": rendered["token_ids"], "generate_chunk": {"choices": [{
                "token_ids": ids[i:i + 1], "logprobs": {"content": content[i:i + 1]},
                "finish_reason": tokens["finish_reason"] if i == len(ids) - 1 else None}]}})
        assert r.status_code == 200, r.text
        state, got = r.json()["stream_state"], got + r.json()["chunk"]["choices"]
    assert "".join(c["text"] for c in got) == "".join(c["text"] for c in coupled)
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in got for x in c["logprobs"][key]] == [x for c in coupled for x in c["logprobs"][key]], key


def test_chat_derender_resolves_logprobs_by_token_id(plain: Any) -> None:
    """Non-streamed and streamed: generate's logprobs by token id come back as the coupled reply's (token text and
    bytes, the top_logprobs cut)."""
    body = {"model": "t", "messages": ASK, "max_tokens": 6, "temperature": 0.0, "logprobs": True, "top_logprobs": 2}
    coupled = plain.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    rendered = plain.post("/v1/chat/completions/render", json=body).json()
    tokens = plain.post(GENERATE, json=rendered).json()["choices"][0]
    r = plain.post("/v1/chat/completions/derender", json={"model": "t", "chat_request": body,
                                                           "generate_response": {"choices": [tokens]}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"]["content"] == coupled
    state, entries = None, []
    ids, content = tokens["token_ids"], tokens["logprobs"]["content"]
    for i in range(0, len(ids), 2):
        r = plain.post("/v1/chat/completions/derender", json={
            "stream": True, "model": "t", "stream_state": state, "chat_request": body, "generate_chunk": {"choices": [{
                "token_ids": ids[i:i + 2], "logprobs": {"content": content[i:i + 2]}, "finish_reason": None}]}})
        assert r.status_code == 200, r.text
        state = r.json()["stream_state"]
        entries += [e for c in r.json()["chunk"]["choices"] for e in (c["logprobs"] or {}).get("content", [])]
    assert entries == coupled


@pytest.mark.parametrize("change, param", [
    ({"generate_chunk": {"choices": [{"token_ids": [5]}, {"token_ids": [6]}]}}, "generate_chunk.choices"),
    ({"stream_state": {"text": "ab", "sent": 3}}, "stream_state"),
    ({"stream_state": {"window": [1 << 30]}}, "stream_state.window"),
    ({"stream_state": {"finished": True}}, "stream_state"),
    ({"stream_state": {"secret": 1}}, "stream_state.secret"),
    ({"generate_chunk": {"choices": [{"token_ids": [5] * 600}]}}, "generate_chunk.choices[0].token_ids"),
    ({"stream_state": {"num_tokens": 511}}, "generate_chunk.choices[0].token_ids"),  # (past max_model_len)
    ({"generate_chunk": {"choices": [{"token_ids": [5]}], "output_mode": "text"}}, "generate_chunk.output_mode"),
])
def test_streamed_derender_refusals_name_the_field(plain: Any, change: dict, param: str) -> None:
    assert plain.get("/v1/models").json()["data"][0]["max_model_len"] == 512  # (the sizes above are past it)
    body = {"stream": True, "model": "t", "generate_chunk": {"choices": [{"token_ids": [5, 6]}]}, **change}
    for extra in ({}, {"chat_request": {"model": "t", "messages": ASK}}):
        r = plain.post("/v1/chat/completions/derender", json={**body, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
    r = plain.post("/v1/completions/derender", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def _ids(http: Any, text: str) -> list[int]:
    return http.post("/tokenize", json={"model": "t", "prompt": text, "add_special_tokens": False}).json()["tokens"]


@pytest.mark.parametrize("chunking", ["whole", "per_token", "threes"])
def test_parsed_stream_matches_the_whole_derender(parsed: Any, chunking: str) -> None:
    """With a reasoning and a tool parser: reasoning, content and a tool call (finish_reason "tool_calls") streamed
    in any chunking assemble to the non-streamed derender's message; include_reasoning false shows no reasoning."""
    prompt = parsed.post("/v1/chat/completions/render", json={"model": "t", "messages": ASK}).json()["token_ids"]
    cases = [("<think>Two and three.</think>The answer is five.", {}),
             ('<think>Let me check.</think><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
              "</tool_call>", {"tools": TOOLS, "tool_choice": "auto"}),
             ("<think>hidden</think>Shown.", {"include_reasoning": False})]
    for text, extra in cases:
        ids = _ids(parsed, text)
        request = {"model": "t", "messages": ASK, **extra}
        whole = parsed.post("/v1/chat/completions/derender", json={
            "model": "t", "chat_request": request, "generate_response": {"choices": [
                {"token_ids": ids, "finish_reason": "stop"}]}}).json()["choices"][0]
        got = _assemble(_derender(parsed, "/v1/chat/completions/derender", ids, _sizes(len(ids), chunking), "stop",
                                  {"chat_request": request, "prompt_token_ids": prompt}))
        message = whole["message"]
        assert got["content"] == message["content"] and got["reasoning"] == message.get("reasoning"), text
        assert got["tool_calls"] == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                     for c in message.get("tool_calls") or []]
        assert got["finish_reason"] == whole["finish_reason"]
    assert got["reasoning"] is None and got["content"] == "Shown."
    assert whole["finish_reason"] == "stop"


def test_parsed_stream_needs_the_request_and_prompt(parsed: Any) -> None:
    """On a server with parsers, as vLLM: chat_request is needed (plain detokenizing would leave the markup in
    the content), and so are the prompt's ids (whether the prompt left the reasoning open)."""
    chunk = {"choices": [{"token_ids": [1, 2]}]}
    r = parsed.post("/v1/chat/completions/derender", json={"stream": True, "model": "t", "generate_chunk": chunk})
    assert r.status_code == 400 and "chat_request" in r.json()["error"]["message"], r.text
    r = parsed.post("/v1/chat/completions/derender", json={"stream": True, "model": "t", "generate_chunk": chunk,
                                                            "chat_request": {"model": "t", "messages": ASK}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_token_ids", r.text


@pytest.mark.parametrize("extra", [{}, {"tools": TOOLS, "tool_choice": "required"}, {"include_reasoning": False},
                                   {"logprobs": True, "top_logprobs": 2}])
def test_generate_streams_derender_as_the_chat_route_streams(parsed: Any, extra: dict) -> None:
    """/inference/v1/generate, output_mode "derender", streamed on a server with parsers: the chat route's deltas
    (one role per choice, each chunk's token ids, the same assembled message and logprobs)."""
    body = {"model": "t", "messages": ASK, "max_tokens": 24, "temperature": 0.0, "return_token_ids": True, **extra}
    coupled = [c for e in _events(parsed, "/v1/chat/completions", {**body, "stream": True}) for c in e["choices"]]
    rendered = parsed.post("/v1/chat/completions/render", json=body).json()
    inline = [c for e in _events(parsed, GENERATE, {**rendered, "output_mode": "derender", "stream": True})
              for c in e["choices"]]
    assert [c["delta"].get("role") for c in inline].count("assistant") == 1
    assert _assemble(inline) == _assemble(coupled)
    if extra.get("include_reasoning") is False:
        assert all(c["token_ids"] is None and c.get("logprobs") is None for c in inline)
        return
    assert [t for c in inline for t in c["token_ids"]] == [t for c in coupled for t in c.get("token_ids") or []]
    if "logprobs" in extra:
        tokens = [(e["token"], e["bytes"]) for c in inline if c.get("logprobs") for e in c["logprobs"]["content"]]
        assert tokens == [(e["token"], e["bytes"]) for c in coupled if c.get("logprobs")
                          for e in c["logprobs"]["content"]]


def test_stream_interval_gathers_tokens_into_chunks(plain: Any, parsed: Any) -> None:
    """A request's stream_interval: each chunk but the first and the last gathers that many tokens, the text the
    same; --stream-interval 2 is the least a request gets; 0 is a 400 naming it."""
    body = {"model": "t", "messages": ASK, "max_tokens": 13, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    one = [c for e in _events(plain, "/v1/chat/completions", body) for c in e["choices"]]
    four = [c for e in _events(plain, "/v1/chat/completions", {**body, "stream_interval": 4}) for c in e["choices"]]
    sizes = [len(c["token_ids"]) for c in four if c.get("token_ids")]
    assert sizes == [1, 4, 4, 4], sizes  # (13 tokens: the first at once, then fours; the last ends it)
    assert _assemble(four) == _assemble(one)
    clamped = [c for e in _events(parsed, "/v1/chat/completions", {**body, "stream_interval": 1}) for c in e["choices"]]
    assert [len(c["token_ids"]) for c in clamped if c.get("token_ids")] == [1, 2, 2, 2, 2, 2, 2]
    completion = [c for e in _events(plain, "/v1/completions", {"model": "t", "prompt": "Hi", "max_tokens": 7,
                                                                 "ignore_eos": True, "stream": True,
                                                                 "stream_interval": 3}) for c in e["choices"]]
    assert len(completion) == 3  # (1 + 3 + 3)
    r = plain.post("/v1/chat/completions", json={**body, "stream_interval": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_interval", r.text
