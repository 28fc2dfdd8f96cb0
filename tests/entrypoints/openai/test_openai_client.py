"""The official `openai` client against our server: completions, chat, streaming, n, logprobs, stop, seed."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

MODEL = "tiny"


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_usage_counts_are_the_tokenizers(client: openai.OpenAI, tokenizer: Any) -> None:
    prompt = "The quick brown fox jumps over"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert out.usage.completion_tokens == 7 and out.usage.total_tokens == out.usage.prompt_tokens + 7
    assert out.choices[0].finish_reason == "length" and out.choices[0].text


def test_chat_usage_counts_are_the_tokenizers(client: openai.OpenAI, tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    assert out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens == 5 and out.usage.total_tokens == out.usage.prompt_tokens + 5


@pytest.mark.parametrize("prompt", ["Streaming must join up exactly", "東京の天気は"])
def test_streamed_completion_joins_to_the_greedy_text(client: openai.OpenAI, prompt: str) -> None:
    args = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**args).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"] and chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices


def test_streamed_chat_joins_to_the_greedy_text(client: openai.OpenAI) -> None:
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=20,
                temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**args).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_samples_and_seed(client: openai.OpenAI) -> None:
    args = dict(model=MODEL, prompt="Pick a word:", max_tokens=8, temperature=1.0, n=2, seed=11)
    first = client.completions.create(**args)
    again = client.completions.create(**args)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.choices[0].text != first.choices[1].text
    streamed = list(client.completions.create(stream=True, **args))
    for index in (0, 1):
        joined = "".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == index)
        assert joined == first.choices[index].text


def test_completion_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="Log", max_tokens=4, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    for _token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) <= 2 and max(top.values()) == pytest.approx(value)  # greedy = top-1


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                         temperature=0, logprobs=True, top_logprobs=3,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 3
    for item in content:
        assert len(item.top_logprobs) == 3 and item.top_logprobs[0].logprob == pytest.approx(item.logprob)


def test_stop_string(client: openai.OpenAI) -> None:
    base = client.completions.create(model=MODEL, prompt="Stop here", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2: len(base) // 2 + 2]
    assert stop.strip(), base
    out = client.completions.create(model=MODEL, prompt="Stop here", max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert out.text == base[: base.index(stop)] and out.finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL, prompt="Stop here", max_tokens=16, temperature=0,
                                              stop=[stop], stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == out.text


def test_prompt_forms_and_echo(server, client: openai.OpenAI, tokenizer: Any) -> None:
    ids = tokenizer.encode("Token ids in")
    out = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=3, temperature=0, echo=True)
    assert [c.index for c in out.choices] == [0, 1] and out.choices[0].text == out.choices[1].text
    assert out.choices[0].text.startswith("Token ids in") and out.usage.prompt_tokens == 2 * len(ids)
    out = client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2)
    assert len(out.choices) == 2


def test_tokenize_detokenize_version(server, tokenizer: Any) -> None:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == tokenizer.encode("Hello world") and r["count"] == len(r["tokens"])
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "Hello world"
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"][0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert httpx.get(f"{server.url}/version").json()["version"]
    # vLLM's return_token_strs, and tools shown by the template (as chat renders them: the same ids)
    strs = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(r["tokens"]) and r["token_strs"] is None
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    ask = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    with_tools = httpx.post(f"{server.url}/tokenize", json=ask).json()
    reply = httpx.post(f"{server.url}/v1/chat/completions", json={**ask, "max_tokens": 1, "return_token_ids": True,
                                                                  "tool_choice": "none"}).json()
    assert with_tools["tokens"] == reply["prompt_token_ids"]  # (this template does not show tools: equal to chat)
    bad = httpx.post(f"{server.url}/tokenize", json={"prompt": "x", "tools": [tool]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"


def test_beam_search_and_prefix_cache_metrics(server, client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="Beam me up", max_tokens=6, n=3,
                                    extra_body={"use_beam_search": True, "ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2] and out.usage.completion_tokens == 18
    assert len({c.text for c in out.choices}) == 3
    bad = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "use_beam_search": True, "stream": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream"
    long_prompt = "shared prefix " * 40
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2)
    assert server.metric("pagedllm:prefix_cache_hits_total") > 0
    assert server.metric("pagedllm:prefix_cache_queries_total") >= server.metric("pagedllm:prefix_cache_hits_total")


def test_logit_bias_forces_and_bans(client: openai.OpenAI, tokenizer: Any) -> None:
    a, b = 1234, 4321
    forced = client.completions.create(model=MODEL, prompt="Bias me", max_tokens=4, temperature=0,
                                       logit_bias={str(a): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == tokenizer.decode([a] * 4)
    banned = client.completions.create(model=MODEL, prompt="Bias me", max_tokens=4, temperature=1.0, seed=0,
                                       logit_bias={str(a): -100},
                                       extra_body={"ignore_eos": True, "allowed_token_ids": [a, b]})
    assert banned.choices[0].text == tokenizer.decode([b] * 4)  # a is banned: b is all that is left


def test_prompt_logprobs(client: openai.OpenAI, tokenizer: Any) -> None:
    prompt = "Prompt log-probabilities, please"
    ids = tokenizer.encode(prompt)
    for _ in range(2):  # the second time its blocks are cached: still scored
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                        extra_body={"prompt_logprobs": 2})
        scored = out.choices[0].model_extra["prompt_logprobs"]
        assert scored[0] is None and len(scored) == len(ids)
        for token, entry in zip(ids[1:], scored[1:]):
            assert str(token) in entry and len(entry) <= 3 and entry[str(token)]["logprob"] <= 0.0


def test_continuous_usage_stats_put_usage_in_every_chunk(client: openai.OpenAI) -> None:
    """vLLM's stream_options.continuous_usage_stats (guidellm sends it): each chunk carries its choice's usage
    so far, and the last chunk the request's."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    completion = list(client.completions.create(model=MODEL, prompt="Count with me", max_tokens=6, temperature=0,
                                                stream=True, stream_options=options, extra_body={"ignore_eos": True}))
    counts = [c.usage.completion_tokens for c in completion]
    assert all(c.usage is not None for c in completion) and counts == sorted(counts) and counts[-2:] == [6, 6]
    assert len({c.usage.prompt_tokens for c in completion}) == 1
    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=5, temperature=0, stream=True, stream_options=options,
                                               extra_body={"ignore_eos": True}))
    assert chat[0].choices[0].delta.role == "assistant" and chat[0].usage.completion_tokens == 0
    assert all(c.usage is not None and c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
               for c in chat)
    assert chat[-2].usage.completion_tokens == 5 and not chat[-1].choices
    # without include_usage it changes nothing (as vLLM)
    plain = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, stream=True,
                                           stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in plain)


def test_echo_with_logprobs_scores_the_prompt(client: openai.OpenAI, server, tokenizer: Any) -> None:
    """lm-eval's log-likelihoods (echo, logprobs=1, max_tokens=1): one entry per prompt token, the first null,
    then the generated one; the same values as vLLM's prompt_logprobs, streamed or not, cached prefix or not."""
    prompt = "The quick brown fox jumps over the lazy dog because it was"
    ids = tokenizer.encode(prompt)
    args = dict(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1)
    first = client.completions.create(**args).choices[0]
    lp = first.logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert first.text.startswith(prompt) and "".join(lp.tokens) == first.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:])
    scored = httpx.post(f"{server.url}/v1/completions", timeout=30, json={**args, "echo": False, "logprobs": None,
                                                                          "prompt_logprobs": 0}).json()
    want = [None] + [entry[str(t)]["logprob"] for entry, t in zip(scored["choices"][0]["prompt_logprobs"][1:], ids[1:])]
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(want[1:], abs=1e-5)
    again = client.completions.create(**args).choices[0].logprobs  # the prompt's blocks now cached
    assert again.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    chunks = list(client.completions.create(stream=True, **args))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first.text


def test_echo_with_max_tokens_0_returns_the_scored_prompt_alone(client: openai.OpenAI, tokenizer: Any) -> None:
    prompt = "Scoring a prompt without generating"
    args = dict(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    whole = client.completions.create(**args).choices[0]
    assert whole.text == prompt and len(whole.logprobs.tokens) == len(tokenizer.encode(prompt))
    assert whole.logprobs.token_logprobs[0] is None and "".join(whole.logprobs.tokens) == prompt
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **args) if c.choices]
    assert "".join(c.text for c in chunks) == prompt
    assert [t for c in chunks for t in c.logprobs.token_logprobs] == pytest.approx(whole.logprobs.token_logprobs)
    with pytest.raises(openai.BadRequestError):  # without echo, as vLLM: at least one token
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)


def test_custom_role_reaches_the_template(client: openai.OpenAI, tokenizer: Any) -> None:
    """As vLLM (its test_custom_role): a role outside OpenAI's is passed to the chat template, which renders it."""
    messages = [{"role": "my-custom-role", "content": "what is 1+1?"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                           extra_body={"return_token_ids": True})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "my-custom-role" in text and reply.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)


def test_multi_turn_appending_the_sdks_own_messages(client: openai.OpenAI, tokenizer: Any) -> None:
    """The SDK's everyday pattern: each reply's message object (and its model_dump(), which adds refusal,
    annotations, audio, function_call... as null) appended to the history for the next turn. Every field of
    our replies and OpenAI's is accepted, an unknown message key is ignored (as vLLM), and none of them
    reaches the prompt: it is the plain conversation's."""
    args = dict(model=MODEL, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    messages: list[Any] = [{"role": "user", "content": "Say hi.", "x_client_tag": "ignored"}]
    plain = [{"role": "user", "content": "Say hi."}]
    for turn, as_dict in enumerate((False, True, False)):
        reply = client.chat.completions.create(messages=messages, **args)
        text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        assert reply.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False)), turn
        message = reply.choices[0].message
        dumped = message.model_dump()
        assert "reasoning_content" in dumped and {"refusal", "annotations", "audio", "function_call"} <= set(dumped)
        if as_dict:  # a value too (this model's template shows no earlier reasoning)
            dumped["reasoning_content"] = "Let me think."
        messages += [dumped if as_dict else message, {"role": "user", "content": f"Again {turn}."}]
        plain += [{"role": "assistant", "content": message.content}, {"role": "user", "content": f"Again {turn}."}]
    with pytest.raises(openai.BadRequestError) as e:  # a spoken reply's id: this server has no audio to refer to
        client.chat.completions.create(messages=[plain[0], {**plain[1], "audio": {"id": "audio_1"}}], **args)
    assert e.value.status_code == 400 and e.value.body["param"] == "messages[1].audio"


def test_prompt_tokens_details_report_prefix_cache_hits(client: openai.OpenAI, tiny_llm_dir: Path) -> None:
    """As vLLM: usage.prompt_tokens_details is null by default; with --enable-prompt-tokens-details, chat and
    completions, whole and streamed, report the prompt's tokens found in the prefix cache (none the first time,
    some of them once the same prompt ran). The same server has vLLM's --return-tokens-as-token-ids: logprobs name
    tokens "token_id:<id>" unless a request's return_tokens_as_token_ids is false."""
    from tests.utils import RemoteServer

    prompt = "one two three four five six seven eight nine ten " * 8
    messages = [{"role": "user", "content": prompt}]
    args = dict(model=MODEL, max_tokens=2)
    assert client.completions.create(prompt=prompt, **args).usage.prompt_tokens_details is None
    assert client.chat.completions.create(messages=messages, **args).usage.prompt_tokens_details is None
    srv = RemoteServer(tiny_llm_dir, "--served-model-name", MODEL, "--enable-prompt-tokens-details",
                       "--return-tokens-as-token-ids")
    try:
        c = srv.get_client()
        first = c.completions.create(prompt=prompt, **args).usage
        assert first.prompt_tokens_details is not None and first.prompt_tokens_details.cached_tokens == 0
        again = c.completions.create(prompt=prompt, **args).usage
        assert 0 < again.prompt_tokens_details.cached_tokens < again.prompt_tokens
        c.chat.completions.create(messages=messages, **args)
        chat = c.chat.completions.create(messages=messages, **args).usage
        assert 0 < chat.prompt_tokens_details.cached_tokens < chat.prompt_tokens
        with_usage = dict(stream=True, stream_options={"include_usage": True}, **args)
        for stream in (c.completions.create(prompt=prompt, **with_usage),
                       c.chat.completions.create(messages=messages, **with_usage)):
            usage = [chunk.usage for chunk in stream][-1]
            assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
        logprobs = dict(logprobs=True, top_logprobs=1, **args)
        tokens = [t.token for t in c.chat.completions.create(messages=messages, **logprobs).choices[0].logprobs.content]
        assert tokens and all(t.startswith("token_id:") for t in tokens)
        lp = c.completions.create(prompt=prompt, logprobs=1, **args).choices[0].logprobs
        assert all(t.startswith("token_id:") for t in lp.tokens + [k for top in lp.top_logprobs for k in top])
        text = c.chat.completions.create(messages=messages, extra_body={"return_tokens_as_token_ids": False},
                                         **logprobs).choices[0]
        assert "".join(t.token for t in text.logprobs.content) == text.message.content
    finally:
        srv.stop()


def test_return_token_ids(client: openai.OpenAI) -> None:
    """vLLM's return_token_ids (RL and agent frameworks): completions give each choice its prompt's ids and the ids
    it generated, chat the conversation's ids beside the choices'; streamed, the prompt's come with the first
    chunk and every chunk carries its new ids, which add up to the whole reply's; without it, both are null."""
    args = dict(model=MODEL, max_tokens=5, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = client.completions.create(prompt="The capital of France is", **args)
    choice = whole.choices[0]
    assert len(choice.prompt_token_ids) == whole.usage.prompt_tokens
    assert len(choice.token_ids) == whole.usage.completion_tokens == 5
    chunks = list(client.completions.create(prompt="The capital of France is", stream=True, **args))
    assert chunks[0].choices[0].prompt_token_ids == choice.prompt_token_ids
    assert all(c.choices[0].prompt_token_ids is None for c in chunks[1:])
    assert sum((c.choices[0].token_ids for c in chunks), []) == choice.token_ids
    messages = [{"role": "user", "content": "Say hi."}]
    reply = client.chat.completions.create(messages=messages, **args)
    assert len(reply.prompt_token_ids) == reply.usage.prompt_tokens
    assert len(reply.choices[0].token_ids) == reply.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **args))
    assert chunks[0].prompt_token_ids == reply.prompt_token_ids
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    assert "token_ids" not in chunks[0].choices[0].model_dump()  # (the role's chunk: no key, as vLLM's)
    assert sum((c.choices[0].token_ids for c in chunks[1:]), []) == reply.choices[0].token_ids
    plain = client.chat.completions.create(messages=messages, model=MODEL, max_tokens=2)
    assert plain.prompt_token_ids is None and plain.choices[0].token_ids is None
    plain = client.completions.create(prompt="x", model=MODEL, max_tokens=2)
    assert plain.choices[0].prompt_token_ids is None and plain.choices[0].token_ids is None


TOOLS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if tools %}Tools: {% for t in tools %}{{ t.function.name }} {% endfor %}{% endif %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""A chat template that shows the request's tools (the tiny model's own does not)."""


@pytest.fixture(scope="module")
def forced_usage_app(tiny_llm_dir: Path) -> Any:
    """An in-process app as `pagedllm serve --enable-force-include-usage --chat-template <TOOLS_TEMPLATE>`."""
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.entrypoints.openai.metrics import ServerMetrics
    from tests.utils import thread_engine

    app = build_app(thread_engine(tiny_llm_dir), ServerMetrics(MODEL), [MODEL], [], chat_template=TOOLS_TEMPLATE,
                    force_include_usage=True)
    with TestClient(app) as http:
        yield http


def _chunks(text: str) -> list[dict]:
    """A stream's chunks (its data events before [DONE])."""
    import json

    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_force_include_usage_puts_usage_in_every_chunk(forced_usage_app: Any) -> None:
    """vLLM's --enable-force-include-usage (its test_enable_force_include_usage.py): every chunk of a streamed chat
    or completions reply carries the usage so far, growing, and a last chunk without choices the whole, whatever
    the request's stream_options say; a whole reply is as before."""
    import argparse

    from pagedllm.entrypoints.openai.api_server import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert parser.parse_args(["--enable-force-include-usage"]).enable_force_include_usage
    assert not parser.parse_args([]).enable_force_include_usage
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_completion_tokens": 5, "min_tokens": 5, "temperature": 0, "stream": True}
    for path, body in (("/v1/chat/completions", chat),
                       ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 5, "ignore_eos": True,
                                            "stream": True, "stream_options": {"include_usage": False}})):
        chunks = _chunks(forced_usage_app.post(path, json=body).text)
        usage = [c["usage"] for c in chunks]
        assert all(u is not None and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
                   for u in usage), path
        counts = [u["completion_tokens"] for u in usage]
        assert counts == sorted(counts) and counts[-1] == 5 and not chunks[-1]["choices"], path
    whole = forced_usage_app.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}).json()
    assert whole["usage"]["completion_tokens"] == 2


def test_tokenize_tools_go_through_the_chat_template(forced_usage_app: Any, tokenizer: Any) -> None:
    """vLLM's /tokenize with tools: the chat template shows them, as /v1/chat/completions renders them (the same
    ids); return_token_strs names each token."""
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [tool],
           "return_token_strs": True}
    with_tools = forced_usage_app.post("/tokenize", json=ask).json()
    without = forced_usage_app.post("/tokenize", json={**ask, "tools": None}).json()
    assert "get_time" in tokenizer.decode(with_tools["tokens"])
    assert "get_time" not in tokenizer.decode(without["tokens"])
    assert with_tools["token_strs"] == tokenizer.convert_ids_to_tokens(with_tools["tokens"])
    reply = forced_usage_app.post("/v1/chat/completions", json={
        **{k: v for k, v in ask.items() if k != "return_token_strs"}, "max_tokens": 1, "return_token_ids": True,
        "tool_choice": "none"}).json()
    assert with_tools["tokens"] == reply["prompt_token_ids"] and with_tools["count"] == len(with_tools["tokens"])
