"""vLLM's token-in/token-out API (POST /inference/v1/generate, /inference/v1/abort_requests; issue 45) on the tiny
model: the same greedy tokens and text as /v1/completions, vLLM's reply and chunk shapes, logprobs by token id, an
abort that ends a stream with finish_reason "abort" and frees its blocks, every bad field a 400 naming it, 403
without --enable-scale-out, and --tokens-only's refusals; vLLM's render routes (/v1/chat/completions/render,
/v1/completions/render), whose answers posted to generate as they are give the replies' tokens, and the derender
routes, which turn generate's tokens back into the coupled route's reply."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.utils import RemoteServer

GENERATE, ABORT = "/inference/v1/generate", "/inference/v1/abort_requests"
PROMPT = [1, 422, 1233, 314, 2764, 282]


@pytest.fixture(scope="module")
def scale_out(tiny_llm_dir: Path) -> Iterator[RemoteServer]:
    s = RemoteServer(tiny_llm_dir, "--served-model-name", "tiny", "--max-model-len", "256", "--enable-scale-out")
    yield s
    s.stop()


def _body(**sampling: Any) -> dict:
    return {"model": "tiny", "token_ids": PROMPT, "sampling_params": {"temperature": 0.0, "max_tokens": 8,
                                                                      **sampling}}


def _chunks(url: str, body: dict, on_chunk: Any = None) -> list[dict]:
    chunks = []
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
                if on_chunk is not None:
                    on_chunk(chunks[-1])
    return chunks


def test_generate_matches_completions(scale_out: RemoteServer) -> None:
    """Greedy token ids (and text in output_mode "text") are /v1/completions' for the same prompt ids; vLLM's reply
    shape: generate-tokens-<id>, usage, prompt_token_ids with return_token_ids, no text in tokens mode."""
    url = scale_out.url
    ref = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8,
                                                     "temperature": 0.0, "return_token_ids": True}, timeout=60).json()
    ref_choice = ref["choices"][0]
    r = httpx.post(url + GENERATE, json={**_body(), "request_id": "abc", "return_token_ids": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["request_id"] == "generate-tokens-abc" and body["output_mode"] == "tokens"
    assert body["model"] == "tiny" and body["prompt_token_ids"] == PROMPT
    assert body["usage"]["prompt_tokens"] == len(PROMPT) and body["usage"]["completion_tokens"] == 8
    choice = body["choices"][0]
    assert choice["token_ids"] == ref_choice["token_ids"] and "text" not in choice
    assert choice["finish_reason"] == ref_choice["finish_reason"] and choice["logprobs"] is None
    text = httpx.post(url + GENERATE, json={**_body(), "output_mode": "text"}, timeout=60).json()
    assert text["output_mode"] == "text" and text["choices"][0]["text"] == ref_choice["text"]
    # derender (a server without a tool or reasoning parser): the text as an assistant message; streamed, deltas
    derender = httpx.post(url + GENERATE, json={**_body(), "output_mode": "derender"}, timeout=60).json()
    message = derender["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"] == ref_choice["text"]
    chunks = _chunks(url + GENERATE, {**_body(), "output_mode": "derender", "stream": True})
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant" and "".join(d.get("content") or "" for d in deltas) == ref_choice["text"]
    # an omitted max_tokens is the rest of the context (not vLLM's dataclass default of 16)
    body = _body(ignore_eos=True)
    del body["sampling_params"]["max_tokens"]
    long = httpx.post(url + GENERATE, json=body, timeout=120).json()
    assert len(long["choices"][0]["token_ids"]) == 256 - len(PROMPT)


def test_stream_and_logprobs(scale_out: RemoteServer) -> None:
    """A stream's token ids and text add up to the whole reply's; the prompt ids come in the first chunk only; the
    last choice chunk has the finish reason, then a usage chunk; logprobs name tokens by id, sampled first."""
    url = scale_out.url + GENERATE
    whole = httpx.post(url, json={**_body(logprobs=2), "output_mode": "text"}, timeout=60).json()["choices"][0]
    chunks = _chunks(url, {**_body(logprobs=2), "output_mode": "text", "stream": True, "return_token_ids": True,
                           "stream_options": {"include_usage": True}})
    assert chunks[0]["prompt_token_ids"] == PROMPT and all("prompt_token_ids" not in c for c in chunks[1:])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    choices = [c["choices"][0] for c in chunks[:-1]]
    assert [t for c in choices for t in c["token_ids"]] == whole["token_ids"]
    assert "".join(c["text"] for c in choices) == whole["text"]
    assert choices[-1]["finish_reason"] == "length" and all(c["finish_reason"] is None for c in choices[:-1])
    lp = httpx.post(url, json=_body(logprobs=2), timeout=60).json()["choices"][0]
    assert lp["token_ids"] == whole["token_ids"] and len(lp["logprobs"]["content"]) == 8
    for token_id, entry in zip(lp["token_ids"], lp["logprobs"]["content"]):
        assert entry["token_id"] == token_id and entry["top_logprobs"][0]["token_id"] == token_id
        assert len(entry["top_logprobs"]) == 2 and entry["logprob"] == entry["top_logprobs"][0]["logprob"]
    text_lp = whole["logprobs"]["content"][0]  # text mode: chat's shape
    assert isinstance(text_lp["token"], str) and isinstance(text_lp["bytes"], list)


def test_prompt_token_id_logprobs(scale_out: RemoteServer) -> None:
    """vLLM's prompt_logprob_token_ids / prompt_logprob_start: the scores come back as the base64 of an np.save'd
    float32 [rows, ids] array, row i the ids' log-probabilities as the next token after position start + i (equal
    to prompt_logprobs' entry of a prompt token asked for), -inf for a -1 pad; not streamed; rows counted."""
    import base64
    import io

    import numpy as np

    rows = [[PROMPT[2]], [PROMPT[3], 100], [PROMPT[4], -1], [PROMPT[5]]]
    sampling = {"max_tokens": 1, "prompt_logprobs": 0, "prompt_logprob_token_ids": rows, "prompt_logprob_start": 1}
    r = httpx.post(scale_out.url + GENERATE, json=_body(**sampling), timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    scores = np.load(io.BytesIO(base64.b64decode(data["prompt_token_id_logprobs"])))
    assert scores.shape == (4, 2) and scores.dtype == np.float32
    assert data["prompt_logprobs"][:2] == [None, None]
    for row, target in enumerate(PROMPT[2:]):
        assert scores[row, 0] == pytest.approx(data["prompt_logprobs"][row + 2][str(target)]["logprob"], abs=1e-3)
    assert np.isneginf(scores[[0, 3], 1]).all() and np.isneginf(scores[2, 1]) and np.isfinite(scores[1, 1])
    plain = httpx.post(scale_out.url + GENERATE, json=_body(max_tokens=1), timeout=60).json()
    assert plain["prompt_token_id_logprobs"] is None
    for body, words in ((_body(max_tokens=1, prompt_logprob_token_ids=rows) | {"stream": True}, "cannot be streamed"),
                        (_body(**{**sampling, "prompt_logprob_token_ids": rows[:2]}), "scored rows")):
        r = httpx.post(scale_out.url + GENERATE, json=body, timeout=60)
        assert r.status_code == 400 and words in r.text, r.text
        assert r.json()["error"]["param"] == "sampling_params.prompt_logprob_token_ids", r.text


def test_abort_ends_the_stream_and_frees_its_blocks(scale_out: RemoteServer) -> None:
    """abort_requests names a running stream by its request_id: its last chunk says "abort", it stops early and no
    block stays used; an unknown id is fine (200), a bad body a 400; the legacy /abort_requests needs
    --tokens-only."""
    url = scale_out.url
    aborted: list[str] = []

    def abort_once(chunk: dict) -> None:
        if not aborted and chunk["choices"] and chunk["choices"][0]["token_ids"]:
            r = httpx.post(url + ABORT, json={"request_ids": [chunk["request_id"]]}, timeout=10)
            assert r.status_code == 200
            aborted.append(chunk["request_id"])

    body = {**_body(ignore_eos=True, max_tokens=240), "stream": True, "request_id": "to-abort"}
    chunks = _chunks(url + GENERATE, body, abort_once)
    assert aborted == ["generate-tokens-to-abort"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) < 240
    # a whole (unstreamed) reply ends too, with the tokens it had; a client that leaves frees its request as well
    result: list[httpx.Response] = []
    body = {**_body(ignore_eos=True, max_tokens=240), "request_id": "whole", "sampling_params": {
        **_body(ignore_eos=True, max_tokens=240)["sampling_params"], "n": 2, "temperature": 1.0}}
    thread = threading.Thread(target=lambda: result.append(httpx.post(url + GENERATE, json=body, timeout=60)))
    thread.start()
    while thread.is_alive():
        httpx.post(url + ABORT, json={"request_ids": "generate-tokens-whole"}, timeout=10)
        thread.join(0.05)
    choices = result[0].json()["choices"]
    assert [c["finish_reason"] for c in choices] == ["abort", "abort"]
    assert all(len(c["token_ids"]) < 240 for c in choices)
    # a streaming client that leaves after its first chunk (its request freed whether or not it had finished)
    with httpx.stream("POST", url + GENERATE, json={**_body(ignore_eos=True, max_tokens=240), "stream": True},
                      timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith("data:"))
    deadline = time.monotonic() + 10
    while (state := httpx.get(f"{url}/kv/state", timeout=10).json())["accounting"]["used_blocks"]:
        assert time.monotonic() < deadline, state["accounting"]
        time.sleep(0.1)
    assert httpx.post(url + ABORT, json={"request_ids": "generate-tokens-unknown"}, timeout=10).status_code == 200
    assert httpx.post(url + ABORT, json={}, timeout=10).status_code == 400
    assert httpx.post(f"{url}/abort_requests", json={"request_ids": ["x"]}, timeout=10).status_code == 404


@pytest.mark.parametrize("change, param", [
    ({"sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
    ({"sampling_params": {"prompt_logprob_token_ids": [[1]]}}, "sampling_params.prompt_logprob_token_ids"),
    ({"sampling_params": {"extra_args": {"a": 1}}}, "sampling_params.extra_args"),
    ({"sampling_params": {"max_tokens": None, "min_tokens": 2**31}}, "sampling_params.min_tokens"),
    ({"sampling_params": {"stop": ["x"], "detokenize": False}}, "sampling_params.stop"),
    ({"sampling_params": {"detokenize": False}, "output_mode": "text"}, "sampling_params.detokenize"),
    ({"sampling_params": {"n": 10**6}}, "sampling_params.n"),
    ({"sampling_params": {"temperature": -1.0}}, "sampling_params.temperature"),
    ({"output_mode": "bogus"}, "output_mode"),
    ({"features": {"mm_hashes": {"image": ["h"]}, "mm_placeholders": {"image": [{"offset": 0, "length": 1}]}}},
     "features"),
    ({"content_parts": [{"type": "image_url", "url": "http://x"}]}, "content_parts"),
    ({"kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params"),
    ({"priority": 1}, "priority"),
    ({"token_ids": []}, "token_ids"),
    ({"token_ids": [1, -2]}, "token_ids"),
    ({"token_ids": [1, 10**9]}, "token_ids"),
    ({"token_ids": [1] * 300}, "token_ids"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"unknown_field": 1}, "unknown_field"),
    ({"reasoning_ended": False, "sampling_params": {"structured_outputs": {"choice": ["a", "b"]}}},
     "reasoning_ended"),  # (no --reasoning-parser here: nothing knows where the reasoning ends)
])
def test_bad_fields_are_400s_naming_them(scale_out: RemoteServer, change: dict, param: str) -> None:
    body = _body()
    sampling = {**body["sampling_params"], **change.pop("sampling_params", {})}
    r = httpx.post(scale_out.url + GENERATE, json={**body, "sampling_params": sampling, **change}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert param.split(".")[-1] in error["message"], error


def test_routes_are_403_without_the_flag(server: RemoteServer) -> None:
    r = httpx.post(server.url + GENERATE, json=_body(), timeout=10)
    assert r.status_code == 403 and "--enable-scale-out" in r.json()["error"]["message"]
    assert httpx.post(server.url + ABORT, json={"request_ids": ["x"]}, timeout=10).status_code == 403
    for path in ("/v1/chat/completions/render", "/v1/completions/render"):  # (404 without the flags, as vLLM)
        assert httpx.post(server.url + path, json={"model": "tiny", "prompt": "x"}, timeout=10).status_code == 404


CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.mark.parametrize("extra", [
    {},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {
        "type": "object", "properties": {"colour": {"type": "string", "maxLength": 8}}, "required": ["colour"]}}}},
    {"logit_bias": {"42": 5.0}, "stop": ["zz"], "seed": 3, "top_k": 4},
])
def test_chat_render_then_generate_is_the_chat_reply(scale_out: RemoteServer, extra: dict) -> None:
    """The render's token ids are /tokenize's for the messages; posted to generate as it is, its tokens are
    /v1/chat/completions' (greedy), structured outputs and logit_bias included."""
    url = scale_out.url
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 8, "temperature": 0.0, **extra}
    r = httpx.post(url + "/v1/chat/completions/render", json=body, timeout=60)
    assert r.status_code == 200, r.text
    rendered = r.json()
    ids = httpx.post(url + "/tokenize", json={"model": "tiny", "messages": CHAT}, timeout=60).json()["tokens"]
    assert rendered["token_ids"] == ids and rendered["request_id"].startswith("chatcmpl-")
    assert rendered["sampling_params"]["max_tokens"] == 8 and rendered["reasoning_ended"] is None
    if "response_format" in extra:
        assert "json" in rendered["sampling_params"]["structured_outputs"]
    chat = httpx.post(url + "/v1/chat/completions", json={**body, "return_token_ids": True}, timeout=60).json()
    generated = httpx.post(url + GENERATE, json=rendered, timeout=60)
    assert generated.status_code == 200, generated.text
    assert generated.json()["choices"][0]["token_ids"] == chat["choices"][0]["token_ids"]


def test_messages_render_is_the_chat_render_of_the_same_conversation(scale_out: RemoteServer) -> None:
    """/v1/messages/render (Anthropic's request) renders the chat request it maps onto: the same generate request."""
    url = scale_out.url
    r = httpx.post(url + "/v1/messages/render", json={"model": "tiny", "max_tokens": 5, "messages": CHAT,
                                                       "stop_sequences": ["zz"], "temperature": 0.0}, timeout=60)
    assert r.status_code == 200, r.text
    chat = httpx.post(url + "/v1/chat/completions/render", json={"model": "tiny", "max_tokens": 5, "messages": CHAT,
                                                                 "stop": ["zz"], "temperature": 0.0}, timeout=60)
    assert r.json()["token_ids"] == chat.json()["token_ids"]
    assert r.json()["sampling_params"] == chat.json()["sampling_params"]
    bad = httpx.post(url + "/v1/messages/render", json={"model": "tiny", "messages": CHAT}, timeout=60)
    assert bad.status_code == 400 and "max_tokens" in bad.text  # (Anthropic's required field, its error shape)


def test_completion_render_is_one_generate_request_per_prompt(scale_out: RemoteServer) -> None:
    url = scale_out.url
    for prompt in (["Hello there", "Good morning"], PROMPT):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0.0}
        r = httpx.post(url + "/v1/completions/render", json=body, timeout=60)
        assert r.status_code == 200, r.text
        rendered = r.json()
        ref = httpx.post(url + "/v1/completions", json={**body, "return_token_ids": True}, timeout=60).json()
        assert len(rendered) == len(ref["choices"])
        if len(rendered) > 1:
            assert [g["request_id"][-2:] for g in rendered] == ["-0", "-1"]
        else:
            assert rendered[0]["token_ids"] == PROMPT and rendered[0]["request_id"].startswith("cmpl-")
        for g, choice in zip(rendered, ref["choices"]):
            assert g["token_ids"] == choice["prompt_token_ids"]
            out = httpx.post(url + GENERATE, json=g, timeout=60)
            assert out.status_code == 200, out.text
            assert out.json()["choices"][0]["token_ids"] == choice["token_ids"]


@pytest.mark.parametrize("path, change, param", [
    ("/v1/completions/render", {"echo": True}, "echo"),
    ("/v1/completions/render", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions/render", {"prompt": ""}, "prompt"),
    ("/v1/completions/render", {"max_tokens": 10 ** 6}, "max_tokens"),
    ("/v1/chat/completions/render", {"messages": []}, "messages"),
    ("/v1/chat/completions/render", {"model": "nope"}, "model"),
    ("/v1/chat/completions/render", {"top_logprobs": 2}, "top_logprobs"),
])
def test_render_refusals_name_the_field(scale_out: RemoteServer, path: str, change: dict, param: str) -> None:
    body = {"model": "tiny", "prompt": "Hi", "messages": CHAT, "max_tokens": 4}
    body = {k: v for k, v in {**body, **change}.items() if not (k == "prompt" and "chat" in path)
            and not (k == "messages" and "chat" not in path)}
    r = httpx.post(scale_out.url + path, json=body, timeout=60)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.text
    scale_out.wait_idle()


def test_tokens_only(tiny_llm_dir: Path) -> None:
    """--tokens-only serves the routes without --enable-scale-out, refuses text and stop strings (nothing would
    check them), and serves the legacy /abort_requests."""
    s = RemoteServer(tiny_llm_dir, "--served-model-name", "tiny", "--max-model-len", "256", "--tokens-only")
    try:
        url = s.url + GENERATE
        r = httpx.post(url, json={**_body(), "output_mode": "text"}, timeout=60)
        assert r.status_code == 400 and "requires a tokenizer" in r.json()["error"]["message"]
        r = httpx.post(url, json=_body(stop=["never"]), timeout=60)
        assert r.status_code == 400 and "stop strings" in r.json()["error"]["message"]
        r = httpx.post(url, json=_body(detokenize=False), timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 8
        assert httpx.post(f"{s.url}/abort_requests", json={"request_ids": ["x"]}, timeout=10).status_code == 200
    finally:
        s.stop()


def _chat_reply(url: str, body: dict) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json={**body, "return_token_ids": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_derender_of_generates_tokens_is_the_coupled_reply(scale_out: RemoteServer) -> None:
    """render -> generate -> derender answers what /v1/chat/completions answers: content, finish_reason, token ids
    and usage; also when a stop string ended the reply (the derendered text is cut where the coupled one was)."""
    url = scale_out.url
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 12, "temperature": 0.0}
    words = _chat_reply(url, body)["choices"][0]["message"]["content"].split()
    assert len(words) > 2  # (a stop string that occurs inside the reply)
    for extra in ({}, {"stop": [words[2]]}, {"stop": [words[2]], "include_stop_str_in_output": True}):
        request = {**body, **extra}
        coupled = _chat_reply(url, request)
        rendered = httpx.post(url + "/v1/chat/completions/render", json=request, timeout=60).json()
        generated = httpx.post(url + GENERATE, json=rendered, timeout=60).json()
        r = httpx.post(url + "/v1/chat/completions/derender", json={
            "model": "tiny", "generate_response": generated, "prompt_tokens": len(rendered["token_ids"]),
            "chat_request": {**request, "return_token_ids": True}}, timeout=60)
        assert r.status_code == 200, r.text
        got, want = r.json()["choices"][0], coupled["choices"][0]
        assert got["message"]["content"] == want["message"]["content"], extra
        assert (got["finish_reason"], got["token_ids"]) == (want["finish_reason"], want["token_ids"])
        assert r.json()["usage"]["prompt_tokens"] == coupled["usage"]["prompt_tokens"]
        assert r.json()["usage"]["completion_tokens"] == coupled["usage"]["completion_tokens"]
    assert "stop" in {c["finish_reason"] for c in [got]}  # (the last case ended on its stop string)


def test_completion_derender_is_the_coupled_reply(scale_out: RemoteServer) -> None:
    url = scale_out.url
    body = {"model": "tiny", "prompt": ["Hello there", "Good morning"], "max_tokens": 6, "temperature": 0.0}
    coupled = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    rendered = httpx.post(url + "/v1/completions/render", json=body, timeout=60).json()
    generated = [httpx.post(url + GENERATE, json={**g, "return_token_ids": True}, timeout=60).json()
                 for g in rendered]
    r = httpx.post(url + "/v1/completions/derender", json={"model": "tiny", "generate_responses": generated,
                                                            "completion_request": body}, timeout=60)
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == [c["text"] for c in coupled["choices"]]
    assert r.json()["usage"] == coupled["usage"]


@pytest.mark.parametrize("change, param", [
    ({"stream_state": {}}, "stream_state"),  # (the streamed form's: stream true)
    ({"generate_response": {"choices": [{"token_ids": [5], "logprobs": {"content": [{"token_id": 5, "logprob": 0}]
                                                                        * 2}}]}},
     "generate_response.choices[0].logprobs.content"),  # (one entry per token at most)
    ({"generate_response": {"choices": [{"token_ids": []}]}}, "generate_response.choices[0].token_ids"),
    # passed-through prompt_logprobs bounded as the engine makes them (each key is decoded)
    ({"generate_response": {"choices": [{"token_ids": [5]}], "prompt_logprobs": [None] * 257}},
     "generate_response.prompt_logprobs"),
    ({"generate_response": {"choices": [{"token_ids": [5]}], "prompt_logprobs": [
        {str(i): {"logprob": -1.0} for i in range(30)}]}}, "generate_response.prompt_logprobs[0]"),
    ({"generate_response": {"choices": [{"token_ids": [5], "logprobs": {"content": [{"token_id": 6, "logprob": 0}]}}]}},
     "generate_response.choices[0].logprobs.content[0].token_id"),
    ({"generate_response": {"choices": [{"token_ids": [1 << 30]}]}}, "generate_response.choices[0].token_ids"),
    ({"generate_response": {"choices": [{"token_ids": [5]}], "output_mode": "text"}}, "generate_response.output_mode"),
    ({"chat_request": {"model": "tiny", "messages": []}}, "chat_request.messages"),
    ({"chat_request": {"model": "tiny", "messages": CHAT, "top_k": -5}}, "chat_request.top_k"),
    # sizes bounded by what the request could generate, before any work
    ({"generate_response": {"choices": [{"token_ids": [5]}] * 2}}, "generate_response.choices"),
    ({"generate_response": {"choices": [{"token_ids": [5] * 257}]}}, "generate_response.choices[0].token_ids"),
    ({"prompt_token_ids": [5] * 257}, "prompt_token_ids"),
])
def test_derender_refusals_name_the_field(scale_out: RemoteServer, change: dict, param: str) -> None:
    body = {"model": "tiny", "generate_response": {"choices": [{"token_ids": [5], "finish_reason": "length"}]},
            "chat_request": {"model": "tiny", "messages": CHAT}, **change}
    r = httpx.post(scale_out.url + "/v1/chat/completions/derender", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_completion_derender_cuts_generates_stop_reason_without_the_request(scale_out: RemoteServer) -> None:
    """Without completion_request, a stop string generate reports (stop_reason) is still cut, as vLLM's derender
    cuts it; the text then is /v1/completions' with that stop string."""
    url = scale_out.url
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0}
    words = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"].split()
    assert len(words) > 2
    coupled = httpx.post(url + "/v1/completions", json={**body, "stop": [words[2]]}, timeout=60).json()
    tokens = httpx.post(url + GENERATE, json=_body(max_tokens=12, stop=[words[2]]), timeout=60).json()
    assert tokens["choices"][0]["stop_reason"] == words[2]
    r = httpx.post(url + "/v1/completions/derender", json={"model": "tiny", "generate_responses": [tokens],
                                                            "prompt_token_ids": [PROMPT]}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == coupled["choices"][0]["text"]
