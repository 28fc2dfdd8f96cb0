"""The OpenAI Responses API through the official `openai` SDK against a real server: plain, streamed (the SDK's
event sequence and its stream helper), a function tool round trip, namespace tools, text.format json_schema and
responses.parse, previous_response_id, GET and DELETE, background responses and their cancel, the store's
bounds, and 400s for what we cannot do. Each reply is held to the chat completion of the same conversation: both
run one request path."""
from __future__ import annotations

import json
import random
import re
import string
import time
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from pagedllm.entrypoints.openai.serving_responses import ResponseStore
from tests.utils import thread_engine

MODEL = "tiny"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}}}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather now", "parameters": WEATHER,
        "strict": True}
NAMESPACE = {"type": "namespace", "name": "crm", "description": "Customer records.", "tools": [TOOL]}
"""A namespace tool: its function is shown to the model as crm__get_weather."""


def _chat(client: openai.OpenAI, messages: list[dict], max_tokens: int):
    return client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=max_tokens,
                                          temperature=0)


def test_plain_reply_is_the_chat_reply(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Tell me a story.", instructions="Be brief.",
                                max_output_tokens=10, temperature=0)
    chat = _chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}],
                 10)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == chat.choices[0].message.content
    assert [item.type for item in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    finished_by_length = chat.choices[0].finish_reason == "length"
    assert r.status == ("incomplete" if finished_by_length else "completed")
    if finished_by_length:
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.instructions == "Be brief." and r.max_output_tokens == 10


def test_streamed_events_follow_the_sdk_sequence(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi there"}]}],
                  max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and deltas
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    # the SDK's helper accumulates the events (its final response needs response.completed: a JSON reply ends)
    kwargs.update(max_output_tokens=80, text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER}})
    whole = client.responses.create(**kwargs)
    assert whole.status == "completed"
    with client.responses.stream(**kwargs) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.id != whole.id


def test_function_tool_round_trip(client: openai.OpenAI) -> None:
    question = {"role": "user", "content": "Weather in Paris?"}
    first = client.responses.create(model=MODEL, input=[question], tools=[TOOL], tool_choice="required",
                                    max_output_tokens=80, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    answers = [{"type": "function_call_output", "call_id": c.call_id, "output": "21 C, sunny"} for c in calls]
    second = client.responses.create(model=MODEL, input=[question, *first.output, *answers],
                                     tools=[TOOL], max_output_tokens=8, temperature=0)
    chat_calls = [{"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                  for c in calls]
    chat = client.chat.completions.create(
        model=MODEL, tools=[{"type": "function", "function": {k: TOOL[k] for k in ("name", "description",
                                                                                   "parameters")}}],
        messages=[question, {"role": "assistant", "content": "", "tool_calls": chat_calls},
                  *[{"role": "tool", "tool_call_id": c.call_id, "content": "21 C, sunny"} for c in calls]],
        max_completion_tokens=8, temperature=0)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    # the same turn through previous_response_id: the stored conversation carries the call
    chained = client.responses.create(model=MODEL, previous_response_id=first.id, input=answers, tools=[TOOL],
                                      max_output_tokens=8, temperature=0)
    assert chained.output_text == second.output_text and chained.previous_response_id == first.id
    assert chained.usage.input_tokens == second.usage.input_tokens
    named = client.responses.create(model=MODEL, input=[question], tools=[TOOL], max_output_tokens=80,
                                    tool_choice={"type": "function", "name": "get_weather"}, stream=True)
    named = list(named)
    done = [e.item for e in named if e.type == "response.output_item.done"]
    assert [item.type for item in done] == ["function_call"] and done[0].name == "get_weather"
    jsonschema.validate(json.loads(done[0].arguments), WEATHER)
    # vLLM's test_function_calling_with_streaming_*: the added item's arguments plus the deltas are the done ones
    added = next(e.item for e in named if e.type == "response.output_item.added")
    deltas = "".join(e.delta for e in named if e.type == "response.function_call_arguments.delta")
    arguments_done = next(e for e in named if e.type == "response.function_call_arguments.done")
    assert added.arguments + deltas == arguments_done.arguments == done[0].arguments
    assert added.name == arguments_done.name == "get_weather" and added.call_id == done[0].call_id
    assert not any(e.type == "response.output_text.delta" for e in named)  # no call JSON leaks as text


class City(BaseModel):
    city: str = Field(max_length=10)
    unit: Literal["C", "F"]


def test_text_format_json_schema_and_parse(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="A city as JSON.", max_output_tokens=60, temperature=0,
                                text={"format": {"type": "json_schema", "name": "city", "schema": WEATHER,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), WEATHER)
    assert r.text.format.type == "json_schema"
    parsed = client.responses.parse(model=MODEL, input="A city as JSON.", text_format=City, max_output_tokens=80,
                                    temperature=0)
    assert isinstance(parsed.output_parsed, City)


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="My name is Ada.", instructions="Be kind.",
                                    max_output_tokens=6, temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    # as OpenAI: the earlier input and output carry over, its instructions do not
    chat = _chat(client, [{"role": "user", "content": "My name is Ada."},
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "What is my name?"}], 6)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens


def test_get_and_delete(client: openai.OpenAI, server) -> None:
    r = client.responses.create(model=MODEL, input="Hello", max_output_tokens=4, temperature=0)
    again = client.responses.create(model=MODEL, input="Hello", max_output_tokens=4, temperature=0)
    assert again.usage.input_tokens_details.cached_tokens > 0  # the prompt's blocks are in the prefix cache
    assert r.usage.input_tokens_details.cached_tokens <= again.usage.input_tokens_details.cached_tokens
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage == r.usage
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    unstored = client.responses.create(model=MODEL, input="Hello", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Hello", previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id"


def test_namespace_tools_come_back_by_name_and_namespace(client: openai.OpenAI) -> None:
    """vLLM's test_namespace_tool_separator: a namespace's function is shown to the model as <namespace>__<name>
    (the same prompt and call as chat with that flat tool); its calls come back, streamed or not, as their own
    name and namespace, and go back in (input items, previous_response_id) as the model was shown them."""
    question = {"role": "user", "content": "Weather in Paris?"}
    first = client.responses.create(model=MODEL, input=[question], tools=[NAMESPACE], tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=80, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.namespace == "crm" for c in calls)
    flat = {"type": "function", "function": {"name": "crm__get_weather", "parameters": WEATHER,
                                             "description": "Customer records.\nWeather now"}}
    chat = client.chat.completions.create(model=MODEL, messages=[question], tools=[flat], tool_choice="required",
                                          parallel_tool_calls=False, max_completion_tokens=80, temperature=0)
    chat_calls = chat.choices[0].message.tool_calls
    assert first.usage.input_tokens == chat.usage.prompt_tokens
    assert [c.function.name for c in chat_calls] == ["crm__get_weather"] * len(calls)
    assert [c.arguments for c in calls] == [c.function.arguments for c in chat_calls]
    for name in ("get_weather", "crm__get_weather"):  # its own name (one namespace holds it) or the flat one
        events = list(client.responses.create(model=MODEL, input=[question], tools=[NAMESPACE], stream=True,
                                              tool_choice={"type": "function", "name": name}, max_output_tokens=80))
        items = [e.item for e in events if e.type in ("response.output_item.added", "response.output_item.done")]
        assert [(i.type, i.name, i.namespace) for i in items] == [("function_call", "get_weather", "crm")] * 2
    answers = [{"type": "function_call_output", "call_id": c.call_id, "output": "21 C, sunny"} for c in calls]
    second = client.responses.create(model=MODEL, input=[question, *first.output, *answers], tools=[NAMESPACE],
                                     max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(
        model=MODEL, tools=[flat], max_completion_tokens=8, temperature=0,
        messages=[question, {"role": "assistant", "content": "", "tool_calls": [c.model_dump() for c in chat_calls]},
                  *[{"role": "tool", "tool_call_id": c.call_id, "content": "21 C, sunny"} for c in calls]])
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    chained = client.responses.create(model=MODEL, previous_response_id=first.id, input=answers, tools=[NAMESPACE],
                                      max_output_tokens=8, temperature=0)
    assert chained.output_text == second.output_text and chained.usage.input_tokens == second.usage.input_tokens


def _tokens(logprobs: list) -> list[tuple]:
    return [(lp.token, lp.logprob, lp.bytes, [(t.token, t.logprob) for t in lp.top_logprobs]) for lp in logprobs]


def test_output_logprobs_are_chats(client: openai.OpenAI) -> None:
    """vLLM's test_logprobs: include ['message.output_text.logprobs'] with top_logprobs puts chat's logprobs of the
    same reply on the output_text (streamed: spread over the deltas, whole on the done events); top_logprobs
    without that include is a 400 naming it."""
    kwargs = dict(model=MODEL, input="Hi", max_output_tokens=6, temperature=0, top_logprobs=3,
                  include=["message.output_text.logprobs"])
    r = client.responses.create(**kwargs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                          max_completion_tokens=6, logprobs=True, top_logprobs=3)
    want = _tokens(chat.choices[0].logprobs.content)
    assert _tokens(r.output[-1].content[-1].logprobs) == want and len(want) == 6
    assert all(len(alternatives) == 3 for *_, alternatives in want) and r.top_logprobs == 3
    events = list(client.responses.create(stream=True, **kwargs))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert _tokens(streamed) == want
    done = next(e for e in events if e.type == "response.output_text.done")
    assert _tokens(done.logprobs) == want == _tokens(events[-1].response.output[-1].content[-1].logprobs)
    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert plain.output[-1].content[-1].logprobs == []
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Hi", top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"


def _metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return float(re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M).group(1))


def _idle(server) -> float:
    """The tokens the server has generated, once nothing runs (polled: the gauges follow the engine's steps)."""
    deadline = time.monotonic() + 30
    while _metric(server, "vllm:num_requests_running") or _metric(server, "vllm:num_requests_waiting"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return _metric(server, "vllm:generation_tokens_total")


def _settled(client: openai.OpenAI, response_id: str, timeout: float = 60.0):
    """A background response, polled until it is no longer queued."""
    deadline = time.monotonic() + timeout
    while (got := client.responses.retrieve(response_id)).status == "queued":
        assert time.monotonic() < deadline, "the background response never finished"
        time.sleep(0.05)
    return got


def test_background_responses_are_polled_and_cancelled(client: openai.OpenAI, server) -> None:
    """vLLM's test_stateful: ``background: true`` answers at once with a queued response that GET polls to the
    reply a plain request gets; POST /v1/responses/{id}/cancel stops one still running (its engine request
    aborted) and it stays cancelled; a response made without background is a 400, an unknown id a 404."""
    kwargs = dict(model=MODEL, input="Tell me a story.", max_output_tokens=10, temperature=0)
    plain = client.responses.create(**kwargs)
    queued = client.responses.create(background=True, **kwargs)
    assert queued.status == "queued" and queued.background and queued.output == []
    done = _settled(client, queued.id)
    assert done.background and done.status == plain.status and done.output_text == plain.output_text
    assert done.usage.output_tokens == plain.usage.output_tokens
    chained = client.responses.create(model=MODEL, input="And then?", previous_response_id=queued.id,
                                      max_output_tokens=4, temperature=0)
    assert chained.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a response that is already"):
        client.responses.cancel(queued.id)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response."):
        client.responses.cancel(plain.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")
    again = httpx.get(f"{server.url}/v1/responses/{queued.id}", params={"stream": "true"}, timeout=30)
    assert again.status_code == 400 and again.json()["error"]["param"] == "stream"  # it was not streamed
    # a long one, cancelled while it runs (the tiny random model does not stop before its max_output_tokens)
    generated = _idle(server)
    long = client.responses.create(background=True, model=MODEL, input="Go on.", max_output_tokens=400)
    with pytest.raises(openai.BadRequestError) as e:  # not a turn to continue from before it is done
        client.responses.create(model=MODEL, input="Hi", previous_response_id=long.id)
    assert e.value.body["param"] == "previous_response_id"
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.id == long.id
    assert client.responses.cancel(long.id).status == "cancelled"  # again: the same (as OpenAI)
    assert _idle(server) - generated < 400  # its engine request was aborted
    assert client.responses.retrieve(long.id).status == "cancelled"
    # DELETE of a running one cancels it too
    generated = _idle(server)
    running = client.responses.create(background=True, model=MODEL, input="Go on.", max_output_tokens=400)
    client.responses.delete(running.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(running.id)
    assert _idle(server) - generated < 400


def test_background_responses_are_bounded() -> None:
    """Background responses hold no connection, so their count is bounded apart (MAX_BACKGROUND_RESPONSES at once):
    one more is an OverloadedError (the server's 503 "overloaded") before anything is prepared; a plain request is
    not counted."""
    import asyncio

    from pagedllm.entrypoints.openai.protocol_responses import ResponsesRequest
    from pagedllm.entrypoints.openai.serving import OverloadedError
    from pagedllm.entrypoints.openai.serving_responses import MAX_BACKGROUND_RESPONSES, OpenAIServingResponses

    assert MAX_BACKGROUND_RESPONSES == 1024
    serving = OpenAIServingResponses(chat=None, store=None)  # the bound is checked before either is used
    serving.max_background = 2
    serving._running = {"resp_a": object(), "resp_b": object()}
    background = ResponsesRequest(model=MODEL, input="x", background=True)
    with pytest.raises(OverloadedError, match="2 background responses are running"):
        asyncio.run(serving.create(background, raw=None))
    with pytest.raises(AttributeError):  # a plain one goes on to the request path (here: no chat server)
        asyncio.run(serving.create(ResponsesRequest(model=MODEL, input="x"), raw=None))


def test_streamed_background_responses_resume(client: openai.OpenAI, server) -> None:
    """``background`` with ``stream``: the events as a plain stream's; a client that stops reading leaves it
    running, and GET ?stream=true&starting_after=N (``responses.retrieve(stream=True)``) follows it again from
    event N+1 to its end; once it is done, it is polled as any other (streaming it again is a 400)."""
    kwargs = dict(model=MODEL, input="Tell me a story.", max_output_tokens=10, temperature=0)
    plain = client.responses.create(**kwargs)
    events = list(client.responses.create(background=True, stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[0].response.background
    assert events[-1].type == f"response.{plain.status}" and events[-1].response.output_text == plain.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text
    done = _settled(client, events[0].response.id)
    assert done.status == plain.status and done.output_text == plain.output_text
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.retrieve(done.id, stream=True)
    assert e.value.body["param"] == "stream"
    # a long one: read three events, go away, come back from the third
    stream = client.responses.create(background=True, stream=True, model=MODEL, input="Go on.", max_output_tokens=300)
    first = [next(iter(stream)) for _ in range(3)]
    stream.close()
    response_id = first[0].response.id
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=first[-1].sequence_number))
    assert [e.sequence_number for e in first + rest] == list(range(len(first) + len(rest)))
    final = client.responses.retrieve(response_id)
    assert rest[-1].type == f"response.{final.status}" and final.usage.output_tokens == 300
    text = "".join(e.delta for e in first + rest if e.type == "response.output_text.delta")
    assert text == final.output_text
    bad = httpx.get(f"{server.url}/v1/responses/{response_id}", params={"starting_after": 2}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "starting_after"


@pytest.mark.parametrize("fields, param", [
    ({"background": True, "store": False}, "background"),
    ({"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "custom", "name": "c"}]}]},
     "tools[0].tools[0].type"),
    ({"tools": [{"type": "namespace", "name": "n", "tools": []}]}, "tools[0].tools"),
    ({"tools": [{"type": "namespace", "name": "n", "tools": [TOOL], "colour": 1}]}, "tools[0].colour"),
    ({"tools": [{**NAMESPACE, "name": "a"}, {**NAMESPACE, "name": "b"}],
      "tool_choice": {"type": "function", "name": "get_weather"}}, "tool_choice.name"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "namespace": 1, "arguments": "{}"}]},
     "input[0].namespace"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # this model's template reads no effort
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"truncation": "auto"}, "truncation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "colour": 1}}},
     "text.format.colour"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"max_output_tokens": -1}, "max_output_tokens"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"text": {"format": "json"}}, "text.format"),
    ({"metadata": {"k": "v" * 513}}, "metadata.k"),
])
def test_what_we_cannot_honour_is_a_400_naming_it(server, fields: dict, param: str) -> None:
    body = {"model": MODEL, "input": "Hi", **fields}
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_the_store_is_bounded_in_count_and_bytes() -> None:
    """Bytes as held: compressed JSON plus each entry's own objects (random text: it does not compress)."""
    noise = random.Random(0)

    def text(n: int) -> str:
        return "".join(noise.choice(string.ascii_letters + string.digits) for _ in range(n))

    store = ResponseStore(max_count=3, max_bytes=4000)
    for i in range(5):
        store.put({"id": f"r{i}", "output": []}, [{"role": "user", "content": "x" * 10}])
    assert len(store) == 3 and store.get("r0") is None and store.get("r2") is not None
    store.put({"id": "r5", "output": []}, [])  # r2 was just used: r3 goes first
    assert store.get("r3") is None and store.get("r2") is not None
    store.put({"id": "big", "output": []}, [{"role": "user", "content": text(4000)}])
    assert store.bytes <= 4000 and store.get("big") is not None and len(store) < 3
    store.put({"id": "huge", "output": []}, [{"role": "user", "content": text(6000)}])  # over the whole store
    assert store.get("huge") is None and store.get("big") is not None
    assert store.delete("big") and not store.delete("big")


def test_reasoning_items_from_the_reasoning_parser(tiny_llm_dir) -> None:
    """deepseek_r1 on a model that never writes </think>: the whole reply is one reasoning item (streamed as
    reasoning_text deltas), its text the chat reply's reasoning_content."""
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.entrypoints.openai.metrics import ServerMetrics

    engine = thread_engine(tiny_llm_dir)
    with TestClient(build_app(engine, ServerMetrics("t"), ["t"], [], "deepseek_r1")) as http:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        chat = sdk.chat.completions.create(model="t", messages=[{"role": "user", "content": "Think."}],
                                           max_completion_tokens=10, temperature=0)
        r = sdk.responses.create(model="t", input="Think.", max_output_tokens=10, temperature=0)
        assert r.output[0].type == "reasoning"
        assert r.output[0].content[0].text == chat.choices[0].message.reasoning_content
        events = list(sdk.responses.create(model="t", input="Think.", max_output_tokens=10, temperature=0,
                                           stream=True))
        text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert text == chat.choices[0].message.reasoning_content
        assert events[-1].response.output[0].content[0].text == text


def test_a_stream_that_fails_ends_in_each_apis_error_events(tiny_llm_dir) -> None:
    """--request-timeout passing mid-stream: the Responses stream ends in response.failed and an error event
    (numbered after the rest), the Messages stream in Anthropic's error event."""
    import json as json_

    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.entrypoints.openai.limits import ServingLimits
    from pagedllm.entrypoints.openai.metrics import ServerMetrics

    engine = thread_engine(tiny_llm_dir)
    app = build_app(engine, ServerMetrics("t"), ["t"], [], limits=ServingLimits(request_timeout=0.3))
    with TestClient(app) as http:
        text = http.post("/v1/responses", json={"model": "t", "input": "Go on.", "max_output_tokens": 400,
                                                "stream": True}).text
        events = [json_.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
        assert [e["type"] for e in events[-2:]] == ["response.failed", "error"]
        assert events[-2]["response"]["status"] == "failed" and events[-1]["code"] == "request_timeout"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        text = http.post("/v1/messages", json={"model": "t", "max_tokens": 400, "stream": True,
                                               "messages": [{"role": "user", "content": "Go on."}]}).text
        assert text.rstrip().endswith('"type": "timeout_error", "message": "the request took over 0.3 s (the '
                                      'server\'s request timeout) and was aborted"}}'), text[-300:]
        assert "event: error" in text and "message_stop" not in text
