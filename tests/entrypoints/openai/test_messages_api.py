"""The Anthropic Messages API through the official `anthropic` SDK against a real server: messages.create,
messages.stream and the raw event sequence, stop_sequences, a tool_use round trip, count_tokens, errors in
Anthropic's shape and x-api-key. Each reply is held to the chat completion of the same conversation: both
run one request path."""
from __future__ import annotations

import json
from typing import Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.utils import thread_engine

MODEL = "tiny"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}}}
TOOL = {"name": "get_weather", "description": "Weather now", "input_schema": WEATHER}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                              "parameters": WEATHER}}
ASK = {"role": "user", "content": "Weather in Paris?"}
NOISELESS = {"temperature": 0}
"""Greedy (the SDK has no temperature argument any more; older SDKs and raw clients send it)."""


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_create_is_the_chat_reply(client: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    m = client.messages.create(model=MODEL, max_tokens=10, system="Be brief.", extra_body=NOISELESS,
                               messages=[{"role": "user", "content": "Tell me a story."}])
    chat = oai.chat.completions.create(model=MODEL, max_completion_tokens=10, extra_body=NOISELESS, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat.choices[0].message.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert m.usage.output_tokens == chat.usage.completion_tokens
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert m.stop_sequence is None


def test_stop_sequences(client: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Count for me."}]}]
    whole = client.messages.create(model=MODEL, max_tokens=16, extra_body=NOISELESS, messages=messages).content[0].text
    stop = whole[len(whole) // 2:len(whole) // 2 + 2]
    assert stop.strip(), whole
    m = client.messages.create(model=MODEL, max_tokens=16, extra_body=NOISELESS, messages=messages,
                               stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == whole[:whole.index(stop)]
    # vLLM's min_tokens extra: no stop before that many tokens (the whole reply, here)
    late = client.messages.create(model=MODEL, max_tokens=16, messages=messages, stop_sequences=[stop],
                                  extra_body={**NOISELESS, "min_tokens": 16})
    assert late.stop_reason == "max_tokens" and late.usage.output_tokens == 16


def test_stream_events_and_helper(client: anthropic.Anthropic) -> None:
    kwargs = dict(model=MODEL, max_tokens=12, extra_body=NOISELESS, messages=[{"role": "user", "content": "Hi"}])
    whole = client.messages.create(**kwargs)
    events = list(client.messages.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * len(deltas),
                     "content_block_stop", "message_delta", "message_stop"] and deltas
    assert "".join(deltas) == whole.content[0].text
    prompt = whole.usage.input_tokens + whole.usage.cache_read_input_tokens  # (cache reads: once the prompt ran)
    start = events[0].message.usage  # (sent with the engine's first output: the split is known, as vLLM's test asks)
    assert start.input_tokens + start.cache_read_input_tokens == prompt and start.output_tokens == 0
    assert (start.input_tokens, start.cache_read_input_tokens, start.cache_creation_input_tokens) == \
        (events[-2].usage.input_tokens, events[-2].usage.cache_read_input_tokens,
         events[-2].usage.cache_creation_input_tokens)
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    assert events[-2].usage.input_tokens + events[-2].usage.cache_read_input_tokens == prompt  # the split, cumulative
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt
    assert final.stop_reason == whole.stop_reason


def test_a_stream_opens_with_a_ping(server) -> None:
    """The raw stream's first event is Anthropic's ping (its SDKs skip it), sent at once: message_start waits for
    the engine's first output (its usage splits the prompt), a queued request is not silent meanwhile."""
    body = {"model": MODEL, "max_tokens": 2, "stream": True, "messages": [ASK], **NOISELESS}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, timeout=30) as r:
        kinds = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert kinds[:2] == ["ping", "message_start"] and kinds[-2:] == ["message_delta", "message_stop"], kinds


def test_tool_use_round_trip(client: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    first = client.messages.create(model=MODEL, max_tokens=80, extra_body=NOISELESS, messages=[ASK], tools=[TOOL],
                                   tool_choice={"type": "any"})
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses and all(u.name == "get_weather" and u.id for u in uses)
    for use in uses:
        jsonschema.validate(use.input, WEATHER)
    results = [{"type": "tool_result", "tool_use_id": u.id, "content": "21 C, sunny"} for u in uses]
    second = client.messages.create(model=MODEL, max_tokens=8, extra_body=NOISELESS, tools=[TOOL], messages=[
        ASK, {"role": "assistant", "content": first.content}, {"role": "user", "content": results}])
    chat_messages = [
        ASK, {"role": "assistant", "content": "", "tool_calls": [
            {"id": u.id, "type": "function", "function": {"name": u.name, "arguments": json.dumps(u.input)}}
            for u in uses]},
        *[{"role": "tool", "tool_call_id": u.id, "content": "21 C, sunny"} for u in uses]]
    chat = oai.chat.completions.create(model=MODEL, max_completion_tokens=8, extra_body=NOISELESS, tools=[CHAT_TOOL],
                                       messages=chat_messages)
    assert second.content[0].text == chat.choices[0].message.content
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    with client.messages.stream(model=MODEL, max_tokens=80, extra_body=NOISELESS, messages=[ASK], tools=[TOOL],
                                tool_choice={"type": "tool", "name": "get_weather",
                                             "disable_parallel_tool_use": True}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    jsonschema.validate(final.content[0].input, WEATHER)


class City(BaseModel):
    city: Literal["Paris", "Rome"]  # the SDK moves maxLength into a description: an enum bounds the reply
    unit: Literal["C", "F"]


def test_output_config_format_and_parse(client: anthropic.Anthropic) -> None:
    """Anthropic's structured outputs: output_config.format's schema is enforced; messages.parse reads it."""
    m = client.messages.create(model=MODEL, max_tokens=80, messages=[ASK], extra_body=NOISELESS,
                               output_config={"format": {"type": "json_schema", "schema": WEATHER}})
    jsonschema.validate(json.loads(m.content[0].text), WEATHER)
    parsed = client.messages.parse(model=MODEL, max_tokens=80, messages=[ASK], output_format=City,
                                   extra_body=NOISELESS)
    assert isinstance(parsed.parsed_output, City)


def test_count_tokens_and_cache_reads(client: anthropic.Anthropic) -> None:
    """count_tokens is the whole prompt; a reply's usage splits it as Anthropic does: the tokens found in the prefix
    cache are cache_read_input_tokens (some, once the same prompt ran: whole and streamed), the rest input_tokens."""
    kwargs = dict(model=MODEL, system="Be brief. " * 20, messages=[ASK], tools=[TOOL])
    counted = client.messages.count_tokens(**kwargs)
    first = client.messages.create(max_tokens=1, **kwargs).usage
    assert counted.input_tokens == first.input_tokens + first.cache_read_input_tokens > 0
    again = client.messages.create(max_tokens=1, **kwargs).usage
    assert again.cache_read_input_tokens > 0 and again.input_tokens > 0 and again.cache_creation_input_tokens == 0
    assert again.input_tokens + again.cache_read_input_tokens == counted.input_tokens
    with client.messages.stream(max_tokens=1, **kwargs) as stream:
        streamed = stream.get_final_message().usage
    assert streamed.cache_read_input_tokens > 0
    assert streamed.input_tokens + streamed.cache_read_input_tokens == counted.input_tokens
    events = list(client.messages.create(max_tokens=1, stream=True, **kwargs))  # message_start: the same split
    assert events[0].type == "message_start" and events[-2].type == "message_delta"
    assert events[0].message.usage.cache_read_input_tokens == events[-2].usage.cache_read_input_tokens > 0
    assert events[0].message.usage.input_tokens == events[-2].usage.input_tokens == again.input_tokens


@pytest.mark.parametrize("fields, fragment", [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2000}, "--reasoning-parser"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "less than max_tokens"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"stop_sequences": ["x"] * 1000}, "stop_sequences"),
    ({"container": "c"}, "container"),
    ({"temperature": -1}, "temperature"),
    ({"tools": [{"input_schema": {}}]}, "tools[0].name"),
    ({"system": [{"type": "image"}]}, "system[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x",
                                                  "content": [{"type": "image"}]}]}]}, "content[0].content[0]"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "regex", "pattern": "a"}}}, "output_config.format"),
])
def test_errors_take_anthropic_shape(server, fields: dict, fragment: str) -> None:
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], **fields}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    assert fragment in error["error"]["message"], error


def test_unknown_model_is_anthropic_not_found(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", max_tokens=4, messages=[ASK])
    assert e.value.body["error"]["type"] == "not_found_error"


def test_x_api_key(tiny_llm_dir) -> None:
    """--api-key is taken from the Anthropic SDK's x-api-key header as well as from Authorization."""
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.entrypoints.openai.metrics import ServerMetrics

    engine = thread_engine(tiny_llm_dir)
    with TestClient(build_app(engine, ServerMetrics("t"), ["t"], ["secret"])) as http:
        good = anthropic.Anthropic(base_url="http://testserver", api_key="secret", http_client=http, max_retries=0)
        assert good.messages.create(model="t", max_tokens=2, messages=[ASK]).usage.output_tokens == 2
        bad = anthropic.Anthropic(base_url="http://testserver", api_key="wrong", http_client=http, max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.create(model="t", max_tokens=2, messages=[ASK])
        assert e.value.body["error"]["type"] == "authentication_error"
        bearer = anthropic.Anthropic(base_url="http://testserver", auth_token="secret", http_client=http,
                                     max_retries=0)
        assert bearer.messages.count_tokens(model="t", messages=[ASK]).input_tokens > 0
        assert http.post("/v1/models", headers={"x-api-key": "wrong"}).status_code == 401
