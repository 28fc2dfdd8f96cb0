"""vLLM's token-level extras through the official `openai` client (issue 45 point 4) and its stream_options rule:
return_tokens_as_token_ids (chat and completions, whole and streamed), prompt_logprobs on chat, stream_options only
with stream."""
from __future__ import annotations

from typing import Any

import openai
import pytest

MODEL = "tiny"
AS_IDS = {"return_tokens_as_token_ids": True, "ignore_eos": True}


def _ids(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_chat_tokens_as_token_ids(client: openai.OpenAI, tokenizer: Any) -> None:
    """As vLLM's test: each logprobs token (and each top alternative) is "token_id:<id>"; the ids decode to the
    reply; its bytes stay the token's text's. Streamed, the same ids; false (the default) keeps the text."""
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=6, temperature=0,
                logprobs=True, top_logprobs=2)
    reply = client.chat.completions.create(extra_body={**AS_IDS, "return_token_ids": True}, **args).choices[0]
    content = reply.logprobs.content
    assert _ids([c.token for c in content]) == reply.token_ids
    assert tokenizer.decode(reply.token_ids, skip_special_tokens=True) == reply.message.content
    for item in content:  # (greedy: the top-1 is the token)
        assert _ids([t.token for t in item.top_logprobs])[0] == int(item.token.removeprefix("token_id:"))
        assert item.bytes is not None
    chunks = list(client.chat.completions.create(stream=True, extra_body=AS_IDS, **args))
    streamed = [c.token for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert _ids(streamed) == reply.token_ids
    plain = client.chat.completions.create(extra_body={"ignore_eos": True}, **args).choices[0]
    assert "".join(c.token for c in plain.logprobs.content) == plain.message.content


def test_completion_tokens_as_token_ids(client: openai.OpenAI, tokenizer: Any) -> None:
    """As vLLM's test: with echo and logprobs, the prompt's tokens and the generated ones are all "token_id:<id>",
    and so are the top_logprobs keys (each token's own first, as vLLM's); the ids decode to the whole text; the text
    offsets still count the text (as without it)."""
    args = dict(model=MODEL, prompt="Say 'Hello, world!'", echo=True, max_tokens=5, temperature=0, logprobs=1)
    choice = client.completions.create(extra_body=AS_IDS, **args).choices[0]
    lp = choice.logprobs
    ids = _ids(lp.tokens)
    assert tokenizer.decode(ids, skip_special_tokens=True) == choice.text
    assert lp.tokens[1:] == [next(iter(top)) for top in lp.top_logprobs[1:]]
    plain = client.completions.create(extra_body={"ignore_eos": True}, **args).choices[0].logprobs
    assert lp.text_offset == plain.text_offset and "".join(plain.tokens) == choice.text
    chunks = list(client.completions.create(stream=True, extra_body=AS_IDS, **args))
    assert _ids([t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]) == ids


def test_chat_prompt_logprobs(client: openai.OpenAI) -> None:
    """As vLLM: chat's prompt_logprobs score the rendered conversation, at the top of the reply (one per prompt
    token, the first null), in completions' shape; null without it; refused with stream (400 naming it)."""
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Score this prompt."}], max_tokens=2)
    reply = client.chat.completions.create(extra_body={"prompt_logprobs": 1, "return_token_ids": True}, **args)
    scored = reply.model_extra["prompt_logprobs"]
    assert len(scored) == len(reply.prompt_token_ids) == reply.usage.prompt_tokens and scored[0] is None
    for token, entry in zip(reply.prompt_token_ids[1:], scored[1:]):
        assert str(token) in entry and len(entry) <= 2 and entry[str(token)]["logprob"] <= 0.0
    assert client.chat.completions.create(**args).model_extra.get("prompt_logprobs") is None
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(stream=True, extra_body={"prompt_logprobs": 1}, **args)
    assert e.value.body["param"] == "prompt_logprobs"


def test_stream_options_need_stream(client: openai.OpenAI) -> None:
    """As vLLM: stream_options without stream=true is a 400 naming it (chat and completions); null or {} pass."""
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    completion = dict(model=MODEL, prompt="hi", max_tokens=1)
    for create, args in ((client.chat.completions.create, chat), (client.completions.create, completion)):
        for stream in (False, None):
            with pytest.raises(openai.BadRequestError) as e:
                create(stream_options={"include_usage": True}, **({} if stream is None else {"stream": stream}), **args)
            assert e.value.body["param"] == "stream_options"
        for allowed in (None, {}):
            assert create(extra_body={"stream_options": allowed}, **args).choices


def test_logprob_token_ids_list_exactly_those_tokens(client: openai.OpenAI) -> None:
    """vLLM's logprob_token_ids: each position lists the log-probabilities of exactly the asked tokens and the
    sampled one (in place of the top-N), with the values the top-N gives for the same tokens (greedy, same prompt)."""
    args = dict(model=MODEL, prompt="The weather today", max_tokens=4, temperature=0, logprobs=5)
    top = client.completions.create(extra_body=AS_IDS, **args).choices[0].logprobs.top_logprobs
    asked = [int(k.removeprefix("token_id:")) for k in top[0]][1:4] + [7, 7, 11]  # (7 twice: listed once)
    listed = client.completions.create(extra_body={**AS_IDS, "logprob_token_ids": asked}, **args).choices[0]
    for position, (mine, theirs) in enumerate(zip(listed.logprobs.top_logprobs, top)):
        sampled = listed.logprobs.tokens[position]
        assert set(mine) == {f"token_id:{t}" for t in asked} | {sampled}, position
        for key, value in mine.items():
            if key in theirs:
                assert value == pytest.approx(theirs[key], abs=1e-4), (position, key)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=1,
                                          extra_body={**AS_IDS, "logprob_token_ids": [7, 11]}).choices[0]
    for item in chat.logprobs.content:  # (top_logprobs gives way to the listed ids, as vLLM)
        assert {t.token for t in item.top_logprobs} == {"token_id:7", "token_id:11", item.token}
        ranks_ok = [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs),
                                                                     reverse=True)
        assert ranks_ok  # listed by rank
    for body, word in (({"logprob_token_ids": [1]}, "logprobs"), ({"logprob_token_ids": [10 ** 7], "logprobs": 1},
                                                                  "below"),
                       ({"logprob_token_ids": list(range(129)), "logprobs": 1}, "128"),
                       ({"logprob_token_ids": [1], "logprobs": 1, "use_beam_search": True, "n": 2}, "beam")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=body)
        assert e.value.body["param"] == "logprob_token_ids" and word in e.value.body["message"], e.value.body


def test_completion_truncate_prompt_tokens(client: openai.OpenAI, tokenizer: Any) -> None:
    """As vLLM's test_completion_truncation_side_controls_prompt_truncation: truncate_prompt_tokens keeps that many
    of the prompt's tokens, its last ("left", the default) or its first ("right"); a shorter prompt stays whole;
    a text prompt is cut after tokenizing, echo shows the kept part; -1 is max_model_len - 1; 0, below -1 and
    above max_model_len are 400s naming it; truncation_side other than left / right too."""
    ids = list(range(10, 18))
    args = dict(model=MODEL, max_tokens=1, temperature=0)

    def kept(**extra: Any) -> list[int]:
        choice = client.completions.create(prompt=ids, extra_body={"return_token_ids": True, **extra}, **args)
        return choice.choices[0].prompt_token_ids

    assert kept(truncate_prompt_tokens=4, truncation_side="right") == ids[:4]
    assert kept(truncate_prompt_tokens=4, truncation_side="left") == ids[-4:]
    assert kept(truncate_prompt_tokens=4) == ids[-4:]
    assert kept(truncate_prompt_tokens=20) == ids
    assert kept(truncate_prompt_tokens=-1) == ids
    text = "one two three four five six seven eight nine ten"
    whole = tokenizer.encode(text)
    reply = client.completions.create(prompt=text, echo=True, extra_body={"truncate_prompt_tokens": 3}, **args)
    assert reply.usage.prompt_tokens == 3
    assert reply.choices[0].text.startswith(tokenizer.decode(whole[-3:]))
    chunks = list(client.completions.create(prompt=[ids, ids[:2]], stream=True, extra_body={
        "truncate_prompt_tokens": 3, "truncation_side": "right", "return_token_ids": True}, **args))
    assert sorted(c.choices[0].prompt_token_ids for c in chunks if c.choices and c.choices[0].prompt_token_ids) \
        == [ids[:2], ids[:3]]
    max_model_len = client.models.list().data[0].model_extra["max_model_len"]
    for bad in ({"truncate_prompt_tokens": 0}, {"truncate_prompt_tokens": -2},
                {"truncate_prompt_tokens": max_model_len + 1}, {"truncate_prompt_tokens": 2, "truncation_side": "up"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(prompt=ids, extra_body=bad, **args)
        assert e.value.body["param"] == next(k for k in reversed(bad)), bad
