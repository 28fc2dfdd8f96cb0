"""Tool calling: "required" and a named function always give calls that parse against the tool's
schema (structured outputs), the "auto" parsers on fixed model replies, tool messages in history."""
from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from pagedllm.entrypoints.openai.tool_calls import get_tool_parser
from tests.utils import thread_engine

MODEL = "tiny"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_calls(calls, names=tuple(SCHEMAS)) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_always_calls_a_tool(client: openai.OpenAI) -> None:
    for seed in range(5):
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                               max_tokens=150, temperature=1.0, seed=seed).choices[0]
        assert reply.finish_reason == "tool_calls" and reply.message.content is None
        _check_calls(reply.message.tool_calls)
    one = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=150, seed=1).choices[0]
    assert len(one.message.tool_calls) == 1


def test_named_function_streamed_and_not(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                           max_tokens=60, temperature=1.0, seed=3).choices[0]
    _check_calls(reply.message.tool_calls, ("get_time",))
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                                 max_tokens=60, temperature=1.0, seed=3, stream=True))
    calls = [call for c in chunks if c.choices and c.choices[0].delta.tool_calls
             for call in c.choices[0].delta.tool_calls]
    assert [c.function.name for c in calls] == ["get_time"] and calls[0].index == 0
    assert calls[0].function.arguments == reply.message.tool_calls[0].function.arguments
    # a call forced by name ends with "stop", as OpenAI and vLLM answer ("required" and auto calls: "tool_calls")
    assert reply.finish_reason == "stop"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_tool_results_in_the_history(client: openai.OpenAI) -> None:
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"C\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=8).choices[0]
    assert reply.message.content and not reply.message.tool_calls


NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}


def test_three_turns_send_back_the_sdks_own_tool_call_messages(client: openai.OpenAI) -> None:
    """Issue 45's multi-turn test with tools: each reply's message object, as the SDK returned it (with its
    tool_calls, refusal, annotations...), goes back into the history with the tools' results, for three turns."""
    messages: list = list(ASK)
    for turn in range(3):
        last = turn == 2
        reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                               tool_choice="none" if last else NAMED_TIME,
                                               max_tokens=8 if last else 150, temperature=1.0, seed=turn).choices[0]
        message = reply.message
        if last:
            assert message.content and not message.tool_calls
            break
        _check_calls(message.tool_calls, ("get_time",))
        messages.append(message)
        messages += [{"role": "tool", "tool_call_id": call.id, "content": "18 degrees"} for call in message.tool_calls]
    assert sum(not isinstance(m, dict) for m in messages) == 2


def test_refusals(client: openai.OpenAI) -> None:
    for kwargs, param in ((dict(tool_choice="auto"), "tool_choice"),  # this server has no --tool-call-parser
                          (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
                          (dict(tool_choice="sometimes"), "tool_choice")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=4, **kwargs)
        assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[{"type": "function", "function": {}}])
    assert e.value.body["param"] == "tools[0]"


def test_forced_call_wins_over_response_format(client: openai.OpenAI) -> None:
    """As vLLM: "required" or a named function with response_format gives the call(s) (the forced call is the reply's
    constraint; response_format gives way); vLLM's own structured_outputs with a forced call is refused."""
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "other": {"type": "integer"}}, "required": ["other"]}}}
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, fmt, names in (("required", {"type": "json_object"}, tuple(SCHEMAS)), (named, schema, ("get_time",))):
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                               response_format=fmt, max_tokens=150, temperature=1.0,
                                               seed=2).choices[0]
        assert reply.finish_reason == ("stop" if choice is named else "tool_calls") and reply.message.content is None
        _check_calls(reply.message.tool_calls, names)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=4,
                                       extra_body={"structured_outputs": {"json": WEATHER}})
    assert e.value.body["param"] == "structured_outputs"


@pytest.mark.parametrize("name, reply, content, calls", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
               '</tool_call>', "Let me check.", [("get_weather", {"city": "Paris", "unit": "C"})]),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"x": 1}}'
               '</tool_call>', None, [("a", {}), ("b", {"x": 1})]),
    ("hermes", "No tools needed: 42.", "No tools needed: 42.", []),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC"}}', None, [("get_time", {"zone": "UTC"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": 2}}', None,
     [("a", {}), ("b", {"y": 2})]),
    ("llama3_json", "The time is noon.", "The time is noon.", []),
])
def test_auto_parsers_on_fixed_replies(name: str, reply: str, content, calls) -> None:
    got_content, got_calls = get_tool_parser(name).parse(reply)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


def test_auto_with_a_parser_serves(tiny_llm_dir) -> None:
    """A server with --tool-call-parser hermes: tool_choice defaults to auto; a reply without the
    format's tags stays content (the tiny model writes none)."""
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.entrypoints.openai.metrics import ServerMetrics

    engine = thread_engine(tiny_llm_dir)
    with TestClient(build_app(engine, ServerMetrics("t"), ["t"], [], tool_call_parser="hermes")) as http:
        body = {"messages": ASK, "tools": TOOLS, "max_tokens": 6}
        choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert "tool_calls" not in choice["message"] and choice["message"]["content"]  # none: no key, as vLLM
        stream = http.post("/v1/chat/completions", json={**body, "stream": True}).text
        assert '"finish_reason":"length"' in stream.replace(" ", "")


def test_a_call_cut_by_max_tokens_is_parsed_when_complete(client: openai.OpenAI) -> None:
    """As vLLM: a forced call whose arguments are complete JSON when max_tokens ends it comes back as the call,
    with finish_reason "length"; cut before its end, as vLLM's test_max_tokens_with_tool_choice_required, a named
    or "required" reply has no tool_calls (and no content), streamed or not."""
    named = {"type": "function", "function": {"name": "get_time"}}
    args = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, temperature=1.0, seed=3)
    whole = client.chat.completions.create(max_tokens=60, **args)
    assert whole.choices[0].finish_reason == "stop"  # (forced by name: OpenAI's and vLLM's finish_reason)
    arguments = whole.choices[0].message.tool_calls[0].function.arguments
    n = whole.usage.completion_tokens
    cut = [client.chat.completions.create(max_tokens=m, **args).choices[0] for m in (n - 1, n)]
    complete = [c for c in cut if c.finish_reason == "length"]  # (the end of the JSON, with or without its EOS)
    assert complete and complete[-1].message.tool_calls[0].function.arguments == arguments
    assert complete[-1].message.content is None
    for choice in (named, "required"):  # cut inside the JSON
        for max_tokens in (1, 2):
            short = client.chat.completions.create(max_tokens=max_tokens, **{**args, "tool_choice": choice})
            message = short.choices[0].message
            assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == max_tokens
            assert message.tool_calls is None and message.content is None
        streamed = [c.choices[0] for c in client.chat.completions.create(max_tokens=2, stream=True,
                                                                         **{**args, "tool_choice": choice})
                    if c.choices]
        assert not [call for c in streamed for call in c.delta.tool_calls or []]
        assert not "".join(c.delta.content or "" for c in streamed)
        assert [c.finish_reason for c in streamed if c.finish_reason] == ["length"]


class Address(pydantic.BaseModel):
    city: Literal["Paris", "Oslo"]
    zone: Literal["UTC", "CET"]


class Trip(pydantic.BaseModel):
    """A tool whose schema nests a model: pydantic writes it under $defs with "#/$defs/Address" refs."""

    start: Address
    stops: list[Address] = pydantic.Field(max_length=2)
    direct: bool


def test_pydantic_tools_with_defs(server, client: openai.OpenAI) -> None:
    """"required" and a named choice with a pydantic-generated nested tool: the combined schema of "required"
    nests each tool's parameters, so their $defs move to its root (renamed per tool) and the refs still resolve;
    the call's arguments validate against the pydantic model. The Responses API builds the same schema."""
    trip = openai.pydantic_function_tool(Trip)
    assert "$defs" in trip["function"]["parameters"]
    tools = [trip, TOOLS[1]]
    for choice in ("required", {"type": "function", "function": {"name": "Trip"}}):
        for seed in range(2):
            reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice=choice,
                                                   max_tokens=200, temperature=1.0, seed=seed).choices[0]
            assert reply.finish_reason == ("tool_calls" if choice == "required" else "stop"), reply
            for call in reply.message.tool_calls:
                if call.function.name == "Trip":
                    Trip.model_validate_json(call.function.arguments)
                else:
                    _check_calls([call])
    one = client.chat.completions.create(model=MODEL, messages=ASK, tools=[trip], tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=200, seed=5).choices[0]
    assert [c.function.name for c in one.message.tool_calls] == ["Trip"], one
    Trip.model_validate_json(one.message.tool_calls[0].function.arguments)
    flat = {"type": "function", **trip["function"]}
    r = httpx.post(f"{server.url}/v1/responses", timeout=60, json={  # one call: its JSON ends within the budget
        "model": MODEL, "input": "Plan a trip.", "tools": [flat], "tool_choice": "required", "max_output_tokens": 200,
        "parallel_tool_calls": False, "temperature": 1.0, "seed": 5})
    assert r.status_code == 200, r.text
    calls = [item for item in r.json()["output"] if item["type"] == "function_call"]
    assert len(calls) == 1 and calls[0]["name"] == "Trip", r.json()["output"]
    Trip.model_validate_json(calls[0]["arguments"])


def test_derender_with_a_parser_reads_the_renders_parse_context(tiny_llm_dir) -> None:
    """On a server with --tool-call-parser and --enable-scale-out: generate's output_mode "derender" parses the reply
    with the render's parse_context as chat parses it (a forced call comes back as the coupled reply's call); it
    is a 400 without parse_context or with a tool_choice its tools lack; /v1/chat/completions/derender of the
    generate reply's tokens gives the same call."""
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.entrypoints.openai.metrics import ServerMetrics

    generate = "/inference/v1/generate"
    engine = thread_engine(tiny_llm_dir)
    app = build_app(engine, ServerMetrics("t"), ["t"], [], tool_call_parser="hermes", enable_scale_out=True)
    with TestClient(app) as http:
        named = {"type": "function", "function": {"name": "get_time"}}
        body = {"model": "t", "messages": ASK, "tools": TOOLS, "tool_choice": named, "max_tokens": 60,
                "temperature": 0.0}
        coupled = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        call = coupled["message"]["tool_calls"][0]["function"]
        rendered = http.post("/v1/chat/completions/render", json=body).json()
        assert rendered["parse_context"]["tool_choice"] == named
        r = http.post(generate, json={**rendered, "output_mode": "derender"})
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]
        assert got["message"]["tool_calls"][0]["function"] == call and got["message"]["content"] is None
        assert got["finish_reason"] == coupled["finish_reason"]
        missing = {k: v for k, v in rendered.items() if k != "parse_context"}
        r = http.post(generate, json={**missing, "output_mode": "derender"})
        assert r.status_code == 400 and "parse_context" in r.json()["error"]["message"]
        nope = {**rendered["parse_context"], "tool_choice": {"type": "function", "function": {"name": "nope"}}}
        r = http.post(generate, json={**rendered, "output_mode": "derender", "parse_context": nope})
        assert r.status_code == 400 and "tool_choice" in r.json()["error"]["message"]
        tokens = http.post(generate, json=rendered).json()
        r = http.post("/v1/chat/completions/derender", json={"generate_response": tokens, "chat_request": body})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"] == call
