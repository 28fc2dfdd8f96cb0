"""`pagedllm serve --speculative-config`: the same text as without speculation (streamed or not), vLLM's
spec_decode counters in /metrics, and a request that opts out (``"speculate": false``)."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.utils import RemoteServer

PROMPT = "one two three four five six one two three four five six one two three"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def spec_server(tiny_llm_dir: Path) -> Iterator[RemoteServer]:
    srv = RemoteServer(tiny_llm_dir, "--served-model-name", "tiny", "--speculative-config", json.dumps(NGRAM))
    yield srv
    srv.stop()


def _metric(server: RemoteServer, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    found = re.findall(rf'^pagedllm:{name}_total{{engine="0",model_name="tiny"}} (\S+)$', text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found[0])


def test_served_text_is_the_text_without_speculation(server: RemoteServer, spec_server: RemoteServer) -> None:
    plain, spec = server.get_client(), spec_server.get_client()
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0.0, extra_body={"ignore_eos": True})
    expected = plain.completions.create(**kwargs).choices[0].text
    before = _metric(spec_server, "spec_decode_num_accepted_tokens")
    assert spec.completions.create(**kwargs).choices[0].text == expected
    streamed = "".join(c.choices[0].text for c in spec.completions.create(**kwargs, stream=True) if c.choices)
    assert streamed == expected
    accepted = _metric(spec_server, "spec_decode_num_accepted_tokens") - before
    assert accepted > 0
    assert _metric(spec_server, "spec_decode_num_draft_tokens") >= _metric(spec_server,
                                                                           "spec_decode_num_accepted_tokens")
    assert 'pagedllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="0"}' in \
        httpx.get(f"{spec_server.url}/metrics").text


def test_a_request_opts_out(spec_server: RemoteServer) -> None:
    client = spec_server.get_client()
    before = _metric(spec_server, "spec_decode_num_drafts")
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0.0,
                                    extra_body={"ignore_eos": True, "speculate": False})
    assert out.usage.completion_tokens == 30
    assert _metric(spec_server, "spec_decode_num_drafts") == before
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, extra_body={"speculate": "sometimes"})
    assert "speculate" in str(e.value)
