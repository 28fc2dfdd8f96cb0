"""--max-logprobs and --hf-overrides on `pagedllm serve`, through the official `openai` client, as vLLM's
test_chat_echo.py uses them (--max-logprobs above the vocabulary, top_logprobs / prompt_logprobs of -1): -1 lists
every token, the reply bound (--max-request-tokens' default) follows --max-logprobs, and the default server (20)
refuses more in vLLM's words naming the field."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.utils import RemoteServer

MODEL = "tiny"
VOCAB = 512  # the tiny_model fixture's
MAX_LOGPROBS = 600  # above the vocabulary, as vLLM's test passes its model's (the bound, not a count)
CONTEXT = 4096  # max_position_embeddings through --hf-overrides (the folder says 512)
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def wide(tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    srv = RemoteServer(tiny_model("llama-gqa-untied"), "--served-model-name", MODEL, "--num-kv-blocks", "64",
                       "--max-logprobs", str(MAX_LOGPROBS), "--chat-template", str(template),
                       "--hf-overrides", json.dumps({"max_position_embeddings": CONTEXT}))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def wide_client(wide: RemoteServer) -> openai.OpenAI:
    return wide.get_client()


MESSAGES = [{"role": "user", "content": "t17 t230 t45 t9"}]


def test_chat_minus_one_lists_the_vocabulary(wide_client: openai.OpenAI) -> None:
    """vLLM's test_top_logprobs and test_prompt_logprobs: top_logprobs -1 lists every token; prompt_logprobs -1
    scores every prompt position against every token."""
    reply = wide_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, logprobs=True,
                                                extra_body={"top_logprobs": -1})
    content = reply.choices[0].logprobs.content
    assert len(content) == 1 and len(content[0].top_logprobs) == VOCAB
    ranked = [t.logprob for t in content[0].top_logprobs]
    assert ranked == sorted(ranked, reverse=True)
    scored = wide_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                                 extra_body={"prompt_logprobs": -1}).model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) > 1 and all(len(entry) == VOCAB for entry in scored[1:])


def test_completion_minus_one_and_the_bound(wide_client: openai.OpenAI) -> None:
    """Completions' logprobs -1: every token at each position; counts up to --max-logprobs are served (capped at
    the vocabulary), more refused naming logprobs."""
    choice = wide_client.completions.create(model=MODEL, prompt="t17 t230", max_tokens=2, logprobs=-1,
                                            extra_body={"ignore_eos": True}).choices[0]
    assert [len(top) for top in choice.logprobs.top_logprobs] == [VOCAB, VOCAB]
    assert len(wide_client.completions.create(model=MODEL, prompt="t17", max_tokens=1, logprobs=MAX_LOGPROBS)
               .choices[0].logprobs.top_logprobs[0]) == VOCAB
    with pytest.raises(openai.BadRequestError) as e:
        wide_client.completions.create(model=MODEL, prompt="t17", max_tokens=1, logprobs=MAX_LOGPROBS + 1)
    assert e.value.body["param"] == "logprobs"
    assert f"Requested sample logprobs of {MAX_LOGPROBS + 1}, which is greater than max allowed: {MAX_LOGPROBS}" \
        in e.value.body["message"]


def test_reply_bound_follows_max_logprobs(wide: RemoteServer, wide_client: openai.OpenAI) -> None:
    """The overridden context is the server's max_model_len; the default --max-request-tokens is one whole context
    with --max-logprobs alternatives a token, and a -1 counts as that many (a larger reply is refused, not built)."""
    card = httpx.get(f"{wide.url}/v1/models", timeout=5).json()["data"][0]
    assert card["max_model_len"] == CONTEXT
    cap = (1 + MAX_LOGPROBS) * CONTEXT
    with pytest.raises(openai.BadRequestError) as e:
        wide_client.completions.create(model=MODEL, prompt="t17", n=2, max_tokens=CONTEXT - 8, logprobs=-1)
    assert e.value.body["param"] == "logprobs" and f"at most {cap} " in e.value.body["message"]


def test_default_server_refuses_above_twenty(client: openai.OpenAI) -> None:
    """The default --max-logprobs (20): top_logprobs 21 and -1 (the vocabulary) refused in vLLM's words."""
    for top in (21, -1):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                           logprobs=True, extra_body={"top_logprobs": top})
        assert e.value.body["param"] == "logprobs"
        assert "which is greater than max allowed: 20" in e.value.body["message"]
