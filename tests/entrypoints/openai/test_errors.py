"""Malformed requests get their 4xx and OpenAI's error body; the server keeps serving."""
from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.utils import RemoteServer

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_MSG = [{"role": "user", "content": "hi"}]

# (endpoint, body (dict, or raw bytes), status, param the error must name or None)
CASES = [
    (C, b"{not json", 400, None),
    (C, b"[1, 2, 3]", 400, None),
    (C, {"max_tokens": 5}, 400, "prompt"),
    (C, {"prompt": 42}, 400, "prompt"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": None}, 400, "prompt"),
    (C, {"prompt": None, "prompt_embeds": []}, 400, "prompt"),
    (C, {"prompt": "hi", "prompt_embeds": ["AAAA"]}, 400, "prompt_embeds"),
    ("/invocations", {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    (C, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    (C, {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    (C, {"prompt": "hi", "n": 0}, 400, "n"),
    (C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    (C, {"prompt": "hi", "presence_penalty": 5}, 400, "presence_penalty"),
    (C, {"prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
    (C, {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    (C, {"prompt": "hi", "stop": 7}, 400, "stop"),
    (C, {"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    (C, {"prompt": "hi", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"999999999": 1}}, 400, "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"five": 1}}, 400, "logit_bias"),
    (C, {"prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    (C, {"prompt": "hi", "bad_words": [""]}, 400, "bad_words"),
    (C, {"prompt": "hi", "use_beam_search": True, "n": 2, "logit_bias": {"5": 1}}, 400, "logit_bias"),
    (C, {"prompt": "hi", "response_format": {"type": "xml"}}, 400, "response_format.type"),
    (C, {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {}}}, 400,
     "response_format.json_schema.schema"),
    (C, {"prompt": "hi", "structured_outputs": {"regex": "("}}, 400, "structured_outputs.regex"),
    (C, {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "structured_outputs"),
    (C, {"prompt": "hi", "structured_outputs": {"bogus": 1}}, 400, "structured_outputs"),
    (C, {"prompt": "hi", "structured_outputs": {"json": {"type": "nope"}}}, 400, "structured_outputs.json"),
    (C, {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    (C, {"prompt": "hi", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    (CHAT, {"messages": OK_MSG, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    (CHAT, {"messages": OK_MSG, "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    (CHAT, {"messages": OK_MSG, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {"prompt": "hi", "stream_options": {"include_usage": False}, "stream": False}, 400, "stream_options"),
    (CHAT, {"messages": OK_MSG, "logprob_token_ids": [5]}, 400, "logprob_token_ids"),
    (C, {"prompt": "hi", "no_such_field": 1}, 400, "no_such_field"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, 400,
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "functions": []}, 400, "functions"),
    (C, {"prompt": "hi", "seed": "abc"}, 400, "seed"),
    (CHAT, {"messages": OK_MSG, "seed": -(2 ** 63) - 1}, 400, "seed"),
    (C, {"prompt": [10, 99999999]}, 400, "prompt_token_ids"),
    (C, {"prompt": [-1, 5]}, 400, "prompt_token_ids"),
    (C, {"prompt": "word " * 600}, 400, "prompt"),
    (C, {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard of oz", "content": "hi"}]}, 400, "messages[0].role"),  # (not a name)
    (CHAT, {"messages": [{"role": "", "content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"content": "no role"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": "hello"}, 400, "messages"),
    (CHAT, {"messages": OK_MSG, "max_completion_tokens": 10**6}, 400, "max_tokens"),
    (CHAT, {"messages": OK_MSG, "top_logprobs": 3}, 400, "top_logprobs"),
    (CHAT, {"messages": OK_MSG, "model": "nope"}, 404, "model"),
    ("/v1/nothing-here", {}, 404, None),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
]


@pytest.mark.parametrize("path, body, status, param", CASES, ids=[f"{i}:{c[0]}" for i, c in enumerate(CASES)])
def test_malformed_request(server: RemoteServer, path: str, body, status: int, param: str | None) -> None:
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = httpx.post(f"{server.url}{path}", timeout=30, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error


def test_vllms_words_where_its_clients_match_them(server: RemoteServer) -> None:
    """vLLM's tests match these words (test_prompt_validation.py, test_chat.py::test_long_seed): ours say them,
    still naming the parameter."""
    client = server.get_client()
    with pytest.raises(openai.BadRequestError,
                       match="Either prompt or prompt_embeds must be provided and non-empty") as e:
        client.completions.create(model="tiny", prompt=None, max_tokens=5, extra_body={"prompt_embeds": []})
    assert e.value.body["param"] == "prompt"
    for seed, words in ((-(2 ** 63) - 1, "greater_than_equal"), (2 ** 63, "less_than_equal")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=OK_MSG, max_tokens=2, seed=seed)
        assert words in e.value.message and e.value.body["param"] == "seed", e.value.message


def test_prompt_too_long_names_both_lengths(server: RemoteServer) -> None:
    r = httpx.post(f"{server.url}{C}", json={"prompt": [5] * 600}).json()["error"]
    assert "600" in r["message"] and "512" in r["message"]


def test_still_serving_after_all_of_them(server: RemoteServer) -> None:
    assert len(CASES) >= 20
    r = httpx.post(f"{server.url}{C}", json={"prompt": "fine", "max_tokens": 2})
    assert r.status_code == 200 and httpx.get(f"{server.url}/health").status_code == 200
    assert server.metric("pagedllm:num_requests_running") == 0


def test_api_key(tiny_llm_dir: Path) -> None:
    srv = RemoteServer(tiny_llm_dir, "--api-key", "sesame", "--api-key", "second-key")
    try:
        body = {"prompt": "hi", "max_tokens": 2}
        missing = httpx.post(f"{srv.url}{C}", json=body)
        wrong = httpx.post(f"{srv.url}{C}", json=body, headers={"Authorization": "Bearer nope"})
        for r in (missing, wrong):
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        for key in ("sesame", "second-key"):
            assert httpx.post(f"{srv.url}{C}", json=body, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200
        assert httpx.get(f"{srv.url}/kv/state").status_code == 401  # the KV map's data names requests
        assert httpx.get(f"{srv.url}/kv/state", headers={"Authorization": "Bearer sesame"}).status_code == 200
        assert httpx.get(f"{srv.url}/kv").status_code == 200  # the page holds no data: it sends /kv#key=...
        assert httpx.get(f"{srv.url}/health").status_code == 200  # open without a key
        assert httpx.get(f"{srv.url}/metrics").status_code == 200
    finally:
        srv.stop()
