"""Issue 45 points 3 and 5 through the openai SDK against a real server, as vLLM: chat_template_kwargs
(enable_thinking), a request's chat_template (--trust-request-chat-template), reasoning_effort and Responses'
reasoning.effort, include_reasoning, thinking_token_budget; continue_final_message, add_generation_prompt and echo
on chat and /tokenize; and three turns that send back the SDK's own reply objects with a reasoning parser on.

The tiny random model writes no think tags, so the parser server's template opens <think> itself (deepseek_r1's
way, unless enable_thinking is false): its replies start inside the reasoning, and a thinking budget's forced
</think> is the only way out of it."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.utils import RemoteServer

MODEL = "tiny"
THINKING_TEMPLATE = (
    "{% if reasoning_effort is defined %}<|im_start|>system\neffort {{ reasoning_effort }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is not defined or enable_thinking %}<think>\n{% endif %}{% endif %}")
QUESTION = [{"role": "user", "content": "What is two plus two?"}]
PREFILL = "The answer, in one word, is"


class Answer(BaseModel):
    """response_format's schema as the SDK's parse() sends it (strict: every field required, no others)."""

    answer: Literal["four", "five"]
    sure: bool


@pytest.fixture(scope="module")
def thinking(tiny_llm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    """A server with a thinking-switch template, the deepseek_r1 parser and request templates allowed (and vLLM's
    scale-out routes)."""
    template = tmp_path_factory.mktemp("thinking") / "template.jinja"
    template.write_text(THINKING_TEMPLATE)
    srv = RemoteServer(tiny_llm_dir, "--served-model-name", MODEL, "--chat-template", str(template),
                       "--reasoning-parser", "deepseek_r1", "--trust-request-chat-template", "--enable-scale-out")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def think_client(thinking: RemoteServer) -> openai.OpenAI:
    return thinking.get_client()


def _tokenize(srv: RemoteServer, **body: Any) -> httpx.Response:
    return httpx.post(f"{srv.url}/tokenize", json={"model": MODEL, **body}, timeout=60)


def _refused(call: Any, param: str) -> str:
    with pytest.raises(openai.BadRequestError) as err:
        call()
    assert err.value.body["param"] == param, err.value.body
    return err.value.body["message"]


def test_enable_thinking_changes_the_rendered_prompt(thinking: RemoteServer, think_client: openai.OpenAI,
                                                     tokenizer: Any) -> None:
    think = tokenizer.encode("<think>\n", add_special_tokens=False)
    on = _tokenize(thinking, messages=QUESTION).json()["tokens"]
    off = _tokenize(thinking, messages=QUESTION, chat_template_kwargs={"enable_thinking": False}).json()["tokens"]
    assert on[-len(think):] == think and off == on[:-len(think)]
    reply = think_client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=2, extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                                                  "return_token_ids": True})
    assert reply.prompt_token_ids == off
    # the reserved names are the request's own: never taken from chat_template_kwargs
    for name in ("messages", "add_generation_prompt", "tools", "chat_template"):
        _refused(lambda name=name: think_client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=2, extra_body={"chat_template_kwargs": {name: None}}),
            "chat_template_kwargs")
    r = _tokenize(thinking, messages=QUESTION, chat_template_kwargs={"tokenize": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    # a variable that breaks the template is the request's 400, not the server's 500
    broken = "{{ raise_exception('x') }}"
    r = _tokenize(thinking, messages=QUESTION, chat_template=broken, chat_template_kwargs={"raise_exception": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text


def test_reasoning_effort_reaches_the_template(thinking: RemoteServer, think_client: openai.OpenAI,
                                               client: openai.OpenAI) -> None:
    plain = think_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    low = think_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1, reasoning_effort="low")
    none = think_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1, reasoning_effort="none")
    assert low.usage.prompt_tokens > plain.usage.prompt_tokens  # the template's "effort low" line
    assert none.usage.prompt_tokens < low.usage.prompt_tokens  # effort none: enable_thinking false, no <think>
    resp = think_client.responses.create(model=MODEL, input="Hi", max_output_tokens=16, reasoning={"effort": "high"})
    bare = think_client.responses.create(model=MODEL, input="Hi", max_output_tokens=16)
    assert resp.usage.input_tokens > bare.usage.input_tokens and resp.reasoning.effort == "high"
    # the session server's model template reads neither reasoning_effort nor enable_thinking: refused, not dropped
    _refused(lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1,
                                                    reasoning_effort="low"), "reasoning_effort")
    _refused(lambda: client.responses.create(model=MODEL, input="Hi", reasoning={"effort": "low"}),
             "reasoning.effort")
    _refused(lambda: think_client.responses.create(model=MODEL, input="Hi", reasoning={"summary": "auto"}),
             "reasoning.summary")


def test_request_chat_template_needs_the_trust_flag(thinking: RemoteServer, server: RemoteServer,
                                                   client: openai.OpenAI, tokenizer: Any) -> None:
    template = "{% for m in messages %}{{ m.content }}|{% endfor %}"
    tokens = _tokenize(thinking, messages=QUESTION, chat_template=template).json()["tokens"]
    assert tokens == tokenizer.encode("What is two plus two?|", add_special_tokens=False)
    message = _refused(lambda: client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=1, extra_body={"chat_template": template}), "chat_template")
    assert "--trust-request-chat-template" in message
    r = _tokenize(server, messages=QUESTION, chat_template=template)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def _thinking_span(token_ids: list[int], start: list[int], end: list[int]) -> int:
    """vLLM's count: the tokens after the last ``start`` and before the first ``end`` after it (prompt included)."""
    last = max(i for i in range(len(token_ids) - len(start) + 1) if token_ids[i:i + len(start)] == start)
    opened = last + len(start)
    for i in range(opened, len(token_ids) - len(end) + 1):
        if token_ids[i:i + len(end)] == end:
            return i - opened
    return len(token_ids) - opened


@pytest.mark.parametrize("budget, stream", [(0, False), (5, False), (5, True)])
def test_thinking_token_budget_ends_the_reasoning(think_client: openai.OpenAI, tokenizer: Any, budget: int,
                                                  stream: bool) -> None:
    """As vLLM's test_thinking_token_budget_limits_reasoning: counted over the prompt's and the reply's ids (the
    template's "<think>\n" newline is a thinking token)."""
    start, end = (tokenizer.encode(m, add_special_tokens=False) for m in ("<think>", "</think>"))
    args = dict(model=MODEL, messages=QUESTION, max_tokens=budget + len(end) + 6, temperature=0,
                extra_body={"thinking_token_budget": budget, "ignore_eos": True, "return_token_ids": True})
    if stream:
        chunks = [c for c in think_client.chat.completions.create(**args, stream=True) if c.choices]
        prompt = chunks[0].prompt_token_ids
        ids = [t for c in chunks for t in (getattr(c.choices[0], "token_ids", None) or [])]  # (none: the role's)
        usage = [c for c in think_client.chat.completions.create(
            **args, stream=True, stream_options={"include_usage": True}) if not c.choices][0].usage
    else:
        reply = think_client.chat.completions.create(**args)
        prompt, ids, usage = reply.prompt_token_ids, reply.choices[0].token_ids, reply.usage
        message = reply.choices[0].message
        assert message.content and (message.reasoning_content is None) == (budget <= 1)
    # vLLM's usage.completion_tokens_details.reasoning_tokens: the reply's tokens before the end marker
    assert usage.completion_tokens_details.reasoning_tokens == max(budget - 1, 0)
    assert _thinking_span(prompt, start, end) == 1  # the template's newline: a budget of 0 is spent before the reply
    assert _thinking_span(prompt + ids, start, end) == max(budget, 1)
    assert ids[max(budget - 1, 0):][:len(end)] == end
    unlimited = think_client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=12, temperature=0,
        extra_body={"thinking_token_budget": -1, "ignore_eos": True, "return_token_ids": True})
    assert end not in [unlimited.choices[0].token_ids[i:i + len(end)] for i in range(12)]  # never closed by itself


ANSWER = {"type": "object", "additionalProperties": False, "required": ["answer", "sure"],
          "properties": {"answer": {"enum": ["four", "five"]}, "sure": {"type": "boolean"}}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_holds_the_content_after_the_reasoning(think_client: openai.OpenAI, stream: bool) -> None:
    """As vLLM with a reasoning parser: response_format holds only what follows the reasoning. The reply starts
    inside it (the template opened <think>), a thinking budget ends it (this model never writes </think>), the
    reasoning comes back and the content parses as the schema; without a budget the grammar never begins: the
    reply is all reasoning."""
    args = dict(model=MODEL, messages=QUESTION, max_tokens=60, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}},
                extra_body={"thinking_token_budget": 4})
    if stream:
        deltas = [c.choices[0].delta for c in think_client.chat.completions.create(**args, stream=True) if c.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
    else:
        message = think_client.chat.completions.create(**args).choices[0].message
        reasoning, content = message.reasoning_content, message.content
    assert reasoning
    assert set(json.loads(content)) == {"answer", "sure"}, content
    parsed = think_client.chat.completions.parse(**{**args, "response_format": Answer})
    assert parsed.choices[0].message.parsed.answer in ("four", "five")
    assert parsed.choices[0].message.reasoning_content
    unended = think_client.chat.completions.create(**{**args, "max_tokens": 8, "extra_body": {"ignore_eos": True}})
    assert unended.choices[0].message.reasoning_content and unended.choices[0].message.content is None
    assert unended.usage.completion_tokens_details.reasoning_tokens == 8


def test_render_then_generate_holds_the_grammar_until_the_reasoning_ends(thinking: RemoteServer) -> None:
    """As vLLM's render -> generate: a chat request whose reply starts inside the reasoning renders with
    reasoning_ended false, and generate holds its grammar until the reasoning ends, as chat does: the same tokens
    (here all reasoning: this model never closes it), where a grammar from the first token would force JSON."""
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}}
    chat = httpx.post(f"{thinking.url}/v1/chat/completions", json={**body, "return_token_ids": True},
                      timeout=60).json()["choices"][0]
    rendered = httpx.post(f"{thinking.url}/v1/chat/completions/render", json=body, timeout=60).json()
    assert rendered["reasoning_ended"] is False and "json" in rendered["sampling_params"]["structured_outputs"]
    r = httpx.post(f"{thinking.url}/inference/v1/generate", json=rendered, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == chat["token_ids"]


def test_a_forced_tool_call_after_the_reasoning(think_client: openai.OpenAI) -> None:
    """tool_choice named or "required" with a reasoning parser: the call is the content after the reasoning (a
    thinking budget ends it here); a reply that never leaves its reasoning makes no call."""
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"enum": ["Paris", "Rome"]}}}}}]
    for choice in ({"type": "function", "function": {"name": "weather"}}, "required"):
        reply = think_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=120, temperature=0,
                                                     tools=tools, tool_choice=choice, parallel_tool_calls=False,
                                                     extra_body={"thinking_token_budget": 3})
        message = reply.choices[0].message
        assert message.reasoning_content and message.tool_calls, choice
        assert json.loads(message.tool_calls[0].function.arguments)["city"] in ("Paris", "Rome")
        cut = think_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0,
                                                   tools=tools, tool_choice=choice, extra_body={"ignore_eos": True})
        assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.tool_calls
        assert cut.choices[0].message.reasoning_content


def test_thinking_token_budget_is_refused_without_a_parser(client: openai.OpenAI) -> None:
    message = _refused(lambda: client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=4, extra_body={"thinking_token_budget": 3}), "thinking_token_budget")
    assert "--reasoning-parser" in message
    for bad in (-2, 1.5, True):
        _refused(lambda bad=bad: client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=4, extra_body={"thinking_token_budget": bad}),
            "thinking_token_budget")


def test_include_reasoning_false_drops_it_streamed_or_not(think_client: openai.OpenAI) -> None:
    args = dict(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, logprobs=True)
    extra = {"thinking_token_budget": 4, "ignore_eos": True, "return_token_ids": True}
    shown = think_client.chat.completions.create(**args, extra_body=extra).choices[0]
    hidden = think_client.chat.completions.create(**args, extra_body={**extra, "include_reasoning": False}).choices[0]
    assert shown.message.reasoning_content and shown.message.content
    assert hidden.message.content == shown.message.content
    assert getattr(hidden.message, "reasoning_content", None) is None
    assert hidden.logprobs is None and getattr(hidden, "token_ids", None) is None  # they would show the reasoning
    chunks = list(think_client.chat.completions.create(**args, stream=True,
                                                       extra_body={**extra, "include_reasoning": False}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(getattr(d, "reasoning_content", None) for d in deltas)
    assert "".join(d.content or "" for d in deltas) == shown.message.content


def test_three_turns_send_back_the_sdks_own_messages_with_reasoning(think_client: openai.OpenAI) -> None:
    """Issue 45's multi-turn test with a reasoning parser: each reply object goes back as the SDK returned it."""
    messages: list[Any] = [{"role": "user", "content": "Think, then answer: what is 2+2?"}]
    for turn in range(3):
        reply = think_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                     extra_body={"thinking_token_budget": 3, "ignore_eos": True})
        message = reply.choices[0].message
        assert message.reasoning_content and message.content, turn
        messages.append(message)
        messages.append({"role": "user", "content": f"And turn {turn + 2}?"})
    assert len(messages) == 7


def test_continue_final_message_renders_the_partial_turn(server: RemoteServer, tokenizer: Any) -> None:
    conversation = [*QUESTION, {"role": "assistant", "content": PREFILL}]
    r = _tokenize(server, messages=conversation, add_generation_prompt=False, continue_final_message=True)
    assert tokenizer.decode(r.json()["tokens"]).endswith(PREFILL)  # no end of turn, no new turn
    closed = _tokenize(server, messages=conversation, add_generation_prompt=False).json()["tokens"]
    assert tokenizer.decode(closed).rstrip().endswith("<|im_end|>")
    opened = _tokenize(server, messages=QUESTION).json()["tokens"]  # add_generation_prompt (default): a new turn
    assert tokenizer.decode(opened).endswith("<|im_start|>assistant\n")
    both = _tokenize(server, messages=conversation, continue_final_message=True)  # add_generation_prompt's default
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_continue_final_message(client: openai.OpenAI, stream: bool) -> None:
    """vLLM's test_chat_session_with_echo_and_continue_final_message: echo puts the prefill before the reply."""
    conversation = [*QUESTION, {"role": "assistant", "content": PREFILL}]
    contents = {}
    for echo in (True, False):
        args = dict(model=MODEL, messages=conversation, max_tokens=5, temperature=0,
                    extra_body={"echo": echo, "continue_final_message": True, "add_generation_prompt": False,
                                "ignore_eos": True, "return_token_ids": True})
        if stream:
            chunks = [c for c in client.chat.completions.create(**args, stream=True) if c.choices]
            contents[echo] = "".join(c.choices[0].delta.content or "" for c in chunks)
        else:
            reply = client.chat.completions.create(**args)
            contents[echo] = reply.choices[0].message.content
            assert reply.choices[0].message.role == "assistant" and reply.choices[0].finish_reason == "length"
    assert contents[True] == PREFILL + contents[False]
    _refused(lambda: client.chat.completions.create(
        model=MODEL, messages=conversation, max_tokens=2, extra_body={"continue_final_message": True}),
        "continue_final_message")
    # echo with a new turn opened: the last message is the user's, not the reply's role: nothing is echoed
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0,
                                           extra_body={"ignore_eos": True})
    echoed = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0,
                                            extra_body={"ignore_eos": True, "echo": True})
    assert echoed.choices[0].message.content == plain.choices[0].message.content


def test_responses_thinking_token_budget_matches_chat(think_client: openai.OpenAI) -> None:
    """vLLM's test_thinking_token_budget_responses_api: the same reasoning as chat's, under the same budget."""
    extra = {"thinking_token_budget": 4, "ignore_eos": True}
    chat = think_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0,
                                                extra_body=extra)
    response = think_client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0,
                                             extra_body={"thinking_token_budget": 4})
    reasoning = "".join(part.text for item in response.output if item.type == "reasoning"
                        for part in item.content or [])
    assert reasoning and reasoning == chat.choices[0].message.reasoning_content
    hidden = think_client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0,
                                           extra_body={"thinking_token_budget": 4, "include_reasoning": False})
    assert [item.type for item in hidden.output] == ["message"]


def test_responses_chat_template_kwargs_as_chat(think_client: openai.OpenAI) -> None:
    """vLLM's Responses API takes chat_template_kwargs as chat does (its test_function_call switches
    enable_thinking with it): the same prompt and reply as chat's with the same variables; a reserved name is the
    same 400."""
    for kwargs in ({"enable_thinking": False}, {"enable_thinking": True}):
        extra = {"chat_template_kwargs": kwargs}
        chat = think_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0,
                                                    extra_body=extra)
        response = think_client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=6, temperature=0,
                                                 extra_body=extra)
        assert response.usage.input_tokens == chat.usage.prompt_tokens
        reasoning = "".join(part.text for item in response.output if item.type == "reasoning"
                            for part in item.content or [])
        assert reasoning == (chat.choices[0].message.reasoning_content or "")
        assert response.output_text == (chat.choices[0].message.content or "")
    off = think_client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=6,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    on = think_client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=6)
    assert off.usage.input_tokens < on.usage.input_tokens  # no <think> opened in the prompt
    _refused(lambda: think_client.responses.create(model=MODEL, input=QUESTION,
                                                   extra_body={"chat_template_kwargs": {"messages": None}}),
             "chat_template_kwargs")


def test_forced_token_follows_the_markers() -> None:
    """The worker's rule, multi-token markers: the budget counts from the last open start; a forced end goes on
    token by token; a closed section forces nothing."""
    from pagedllm.sampling_params import thinking_budget_forced_token as forced

    start, end = [7, 8], [5, 6, 9]
    assert forced([1, 7, 8, 2, 3], start, end, 2) == 5 and forced([1, 7, 8, 2, 3], start, end, 3) is None
    assert forced([1, 7, 8, 2, 3, 5], start, end, 2) == 6 and forced([1, 7, 8, 2, 3, 5, 6], start, end, 2) == 9
    assert forced([1, 7, 8, 2, 5, 6, 9, 4], start, end, 0) is None and forced([1, 2, 3], start, end, 0) is None
    assert forced([7, 8, 1, 5, 6, 9, 7, 8], start, end, 0) == 5  # a second section opened


def test_reasoning_tokens_are_counted_inside_the_markers() -> None:
    """usage's reasoning_tokens: the output's tokens inside sections (markers not counted), the output starting
    inside one when the prompt left it open."""
    from pagedllm.sampling_params import reasoning_token_count as count

    start, end = [7, 8], [5, 6, 9]
    assert count([1, 2], [7, 8, 3, 4, 5, 6, 9, 4], start, end) == 2
    assert count([1, 7, 8], [3, 4, 4, 5, 6, 9, 4], start, end) == 3  # opened by the template
    assert count([7, 8, 5, 6, 9], [3, 4], start, end) == 0  # closed in the prompt
    assert count([1], [7, 8, 3, 5, 6, 9, 2, 7, 8, 3, 3], start, end) == 3  # two sections, the last unclosed
    assert count([1], [3, 3], [], end) == 0


@pytest.mark.parametrize("effort, kwargs, want", [
    ("high", None, {"reasoning_effort": "high", "enable_thinking": True}),
    ("none", None, {"reasoning_effort": "none", "enable_thinking": False}),
    ("high", {"enable_thinking": False}, {"reasoning_effort": "high", "enable_thinking": False}),  # the client's
    (None, {"reasoning_effort": "medium"}, {"reasoning_effort": "medium"}),  # straight to the template
    (None, None, {}),
])
def test_reasoning_effort_maps_as_vllms(effort: str | None, kwargs: dict | None, want: dict) -> None:
    """vLLM's test_reasoning_enable_thinking cases: what the template sees."""
    from pagedllm.entrypoints.openai.chat_options import template_options
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(messages=QUESTION, reasoning_effort=effort, chat_template_kwargs=kwargs)
    assert template_options(req, False).kwargs == want
