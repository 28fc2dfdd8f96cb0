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
    ("qwen3", "No thinking here: a < b and c > d.", (None, "No thinking here: a < b and c > d.")),
    ("qwen3", "<think>unfinished", ("unfinished", None)),
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
