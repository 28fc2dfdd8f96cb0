"""--reasoning-parser: <think>...</think> into reasoning_content, whole replies and streamed deltas
(fixed texts: a tiny random model writes no think tags)."""
from __future__ import annotations

import random

import pytest

from pagedllm.entrypoints.openai.reasoning import ReasoningSplit, get_reasoning_parser
from tests.utils import thread_engine

CASES = [  # parser, reply, (reasoning, content)
    ("deepseek_r1", "Let me think. 2+2=4.</think>\n\nThe answer is 4.", ("Let me think. 2+2=4.", "The answer is 4.")),
    ("deepseek_r1", "<think>Hmm.</think>Four.", ("Hmm.", "Four.")),
    ("deepseek_r1", "still thinking, no end", ("still thinking, no end", None)),
    ("qwen3", "<think>\nstep one\n</think>\n\nDone.", ("\nstep one\n", "Done.")),
    # vLLM 0.34's qwen3: the reply starts inside the reasoning; a tool call ends it (and is content)
    ("qwen3", "No thinking here: a < b and c > d.", ("No thinking here: a < b and c > d.", None)),
    ("qwen3", "<think>unfinished", ("unfinished", None)),
    ("qwen3", "Plan.</think>\n\nAnswer.", ("Plan.", "Answer.")),
    ("qwen3", "Call it.\n<tool_call>\n{}\n</tool_call>", ("Call it.\n", "<tool_call>\n{}\n</tool_call>")),
]


@pytest.mark.parametrize("name, reply, want", CASES)
def test_whole_reply(name: str, reply: str, want: tuple) -> None:
    split = get_reasoning_parser(name).split(reply)
    assert (split.reasoning, split.content) == want


@pytest.mark.parametrize("name, reply, want", CASES)
def test_streamed_deltas_join_to_the_whole_split(name: str, reply: str, want: tuple) -> None:
    parser = get_reasoning_parser(name)
    rng = random.Random(len(reply))
    for _ in range(20):  # random cuts, tags split across deltas included
        cuts = sorted(rng.sample(range(1, len(reply)), min(6, len(reply) - 1)))
        pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]
        stream = parser.stream()
        got = [stream.delta(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
        joined = ReasoningSplit("".join(g.reasoning or "" for g in got) or None,
                                "".join(g.content or "" for g in got) or None)
        whole = parser.split(reply)
        assert (joined.reasoning, joined.content) == (whole.reasoning, whole.content), pieces
        assert not any("<think" in (g.reasoning or "") + (g.content or "") for g in got if name == "qwen3")
        assert not any("<tool" in (g.reasoning or "") for g in got)


def test_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="known"):
        get_reasoning_parser("o1")


def test_server_puts_an_unclosed_reply_in_reasoning_content(tiny_llm_dir) -> None:
    """deepseek_r1 on a model that never writes </think>: the whole greedy reply is reasoning,
    streamed or not, and equals the reply of a server without the parser."""
    import json

    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.entrypoints.openai.metrics import ServerMetrics

    body = {"messages": [{"role": "user", "content": "Think first."}], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    replies = {}
    for parser in (None, "deepseek_r1"):
        engine = thread_engine(tiny_llm_dir)
        with TestClient(build_app(engine, ServerMetrics("t"), ["t"], [], parser)) as client:
            message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
            lines = client.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
            deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in lines if line.startswith("data: {")]
            replies[parser] = (message, deltas)
    plain, _ = replies[None]
    message, deltas = replies["deepseek_r1"]
    assert message["reasoning_content"] == plain["content"] and message["content"] is None
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == plain["content"]
    assert not "".join(d.get("content") or "" for d in deltas)


@pytest.mark.parametrize("kwargs, prompt, reply, want", [
    ({"enable_thinking": False}, "<|im_start|>assistant\n", "<think>a</think>b", (None, "<think>a</think>b")),
    ({"enable_thinking": 0}, "<|im_start|>assistant\n", "plain", (None, "plain")),
    ({}, "<|im_start|>assistant\n<think>\n\n</think>\n\n", "plain", (None, "plain")),  # closed this turn
    ({}, "<think>old</think><|im_end|>\n<|im_start|>assistant\n", "new", ("new", None)),  # an earlier turn's
    ({"enable_thinking": True}, "<|im_start|>assistant\n", "plain", ("plain", None)),
    ({}, "<|im_start|>assistant\n", 'why</think>\n{"a": 1}', ("why", '{"a": 1}')),  # a grammar's, after it
])
def test_qwen3_per_request(kwargs: dict, prompt: str, reply: str, want: tuple) -> None:
    """As vLLM 0.34's qwen3 parser: thinking off (chat_template_kwargs) is all content; so is a reply whose
    prompt closed the reasoning in its own turn. A grammar changes nothing here (it holds what follows the
    reasoning). The server's parser is left as it was."""
    shared = get_reasoning_parser("qwen3")
    per_request = shared.for_request(kwargs, prompt)
    split = per_request.split(reply)
    assert (split.reasoning, split.content) == want
    assert per_request.reasons_first == (want[0] is not None)
    assert shared.split("plain").reasoning == "plain"


def test_reasoning_config_is_vllms_json() -> None:
    from pagedllm.entrypoints.openai.reasoning import ReasoningConfig, parse_reasoning_config

    config = parse_reasoning_config('{"reasoning_start_str": "<think>", "reasoning_end_str": "Done.</think>"}')
    assert config.markers(get_reasoning_parser("qwen3")) == ("<think>", "Done.</think>", "</think>")
    assert config.markers(None) == ("<think>", "Done.</think>", "Done.</think>")
    assert ReasoningConfig().markers(get_reasoning_parser("deepseek_r1")) == ("<think>", "</think>", "</think>")
    assert ReasoningConfig().markers(None) is None and ReasoningConfig(reasoning_end_str="x").markers(None) is None
    for bad, words in (("[1]", "JSON object"), ("{", "JSON object"), ('{"start": "a"}', "no key 'start'"),
                       ('{"reasoning_end_str": 3}', "must be a string")):
        with pytest.raises(ValueError, match=words):
            parse_reasoning_config(bad)
    with pytest.raises(ValueError, match="--reasoning-parser"):
        parse_reasoning_config('{"reasoning_parser": "qwen3"}').check_parser(None)
    parse_reasoning_config('{"reasoning_parser": "qwen3"}').check_parser("qwen3")


def test_forced_end_phrase() -> None:
    """--reasoning-config's reasoning_end_str: a spent budget forces the whole phrase, token by token; the section
    is closed by the phrase or by the natural end marker."""
    from pagedllm.sampling_params import thinking_budget_forced_token as forced

    start, end, phrase = [7, 8], [9], [4, 4, 9]
    assert forced([7, 8, 1, 2], start, end, 2, phrase) == 4
    assert forced([7, 8, 1, 2, 4], start, end, 2, phrase) == 4
    assert forced([7, 8, 1, 2, 4, 4], start, end, 2, phrase) == 9
    assert forced([7, 8, 1, 2, 4, 4, 9], start, end, 2, phrase) is None
    assert forced([7, 8, 1, 9, 2, 3], start, end, 0, phrase) is None  # closed by the model
    assert forced([7, 8, 1, 2, 3, 4, 4, 5], start, [6], 2, phrase) == 4  # no match of the phrase: forced again
    assert forced([7, 8, 1], start, end, 2, phrase) is None


@pytest.fixture(scope="module")
def qwen3_app(tiny_llm_dir):
    """An in-process server with the qwen3 parser and a --reasoning-config whose forced end is a phrase."""
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.entrypoints.openai.metrics import ServerMetrics
    from pagedllm.entrypoints.openai.reasoning import ReasoningConfig

    config = ReasoningConfig(reasoning_end_str=" OK.</think>")
    with TestClient(build_app(thread_engine(tiny_llm_dir), ServerMetrics("t"), ["t"], [], "qwen3",
                              reasoning_config=config)) as client:
        yield client


BODY = {"model": "t", "messages": [{"role": "user", "content": "What is 1+1?"}], "max_tokens": 8,
        "temperature": 0, "ignore_eos": True}


def _deltas(client, body: dict) -> list[dict]:
    import json

    lines = client.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_qwen3_server_reasoning_as_vllm(qwen3_app) -> None:
    """vLLM 0.34's qwen3 on a model that writes no think tags (SmolLM2 stands in for Qwen3 in vLLM's tests): the
    whole reply is reasoning, under both names (vLLM 0.34's ``reasoning``), streamed or not, and every token is a
    reasoning token in usage (the batch route's too); include_reasoning false leaves it out; thinking off makes it
    content, with no reasoning tokens. A response_format holds only what follows the reasoning (as vLLM): with no
    </think> the reply stays reasoning; with thinking off the grammar holds it from the first token."""
    reply = qwen3_app.post("/v1/chat/completions", json=BODY).json()
    message, usage = reply["choices"][0]["message"], reply["usage"]
    assert message["reasoning"] == message["reasoning_content"] and message["reasoning"] and message["content"] is None
    assert usage["completion_tokens_details"]["reasoning_tokens"] == usage["completion_tokens"] == 8
    chunks = _deltas(qwen3_app, {**BODY, "stream_options": {"include_usage": True}})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == 8
    hidden = qwen3_app.post("/v1/chat/completions", json={**BODY, "include_reasoning": False}).json()
    assert hidden["choices"][0]["message"].get("reasoning") is None
    assert hidden["usage"]["completion_tokens_details"]["reasoning_tokens"] == 8  # hidden, still counted
    batch = qwen3_app.post("/v1/chat/completions/batch", json={**BODY, "messages": [BODY["messages"]] * 2,
                                                               "include_reasoning": False}).json()
    assert batch["usage"]["completion_tokens_details"]["reasoning_tokens"] == batch["usage"]["completion_tokens"]
    off = qwen3_app.post("/v1/chat/completions", json={**BODY, "chat_template_kwargs": {"enable_thinking": False}})
    off_message = off.json()["choices"][0]["message"]
    assert off_message["content"] == message["reasoning"] and off_message.get("reasoning") is None
    assert off.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    off_deltas = _deltas(qwen3_app, {**BODY, "chat_template_kwargs": {"enable_thinking": False}})
    assert not any(c["choices"][0]["delta"].get("reasoning") for c in off_deltas if c["choices"])
    json_body = {**BODY, "max_tokens": 12, "response_format": {"type": "json_object"}}
    json_reply = qwen3_app.post("/v1/chat/completions", json=json_body).json()
    json_message = json_reply["choices"][0]["message"]
    assert json_message["reasoning"].startswith(message["reasoning"])  # unmasked: the tokens of the free reply
    assert json_message["content"] is None
    assert json_reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == 12
    off_json = qwen3_app.post("/v1/chat/completions", json={**json_body, "chat_template_kwargs": {
        "enable_thinking": False}}).json()["choices"][0]["message"]
    assert off_json.get("reasoning") is None and off_json["content"].startswith("{")


def test_incoming_reasoning_reaches_the_template(qwen3_app) -> None:
    """An assistant message may carry vLLM 0.34's ``reasoning`` (it wins over ``reasoning_content``, as vLLM)."""
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "reasoning": "greet"},
             {"role": "user", "content": "Bye"}]
    assert qwen3_app.post("/v1/chat/completions", json={**BODY, "messages": turns}).status_code == 200
    both = [turns[0], {**turns[1], "reasoning_content": "other"}, turns[2]]
    assert qwen3_app.post("/v1/chat/completions", json={**BODY, "messages": both}).status_code == 200


def test_thinking_token_budget_forces_the_configured_phrase(qwen3_app, tokenizer) -> None:
    """--reasoning-config's reasoning_end_str is what a spent budget forces; the reasoning then ends at its
    </think> (a prefill opens the reasoning: the model writes no <think> itself)."""
    phrase = tokenizer.encode(" OK.</think>", add_special_tokens=False)
    body = {**BODY, "messages": [*BODY["messages"], {"role": "assistant", "content": "<think>"}],
            "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 3 + len(phrase) + 4,
            "thinking_token_budget": 3, "return_token_ids": True}
    reply = qwen3_app.post("/v1/chat/completions", json=body).json()
    ids = reply["choices"][0]["token_ids"]
    assert ids[3:3 + len(phrase)] == phrase
    assert reply["choices"][0]["message"]["reasoning"].endswith(" OK.")
