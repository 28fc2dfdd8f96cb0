"""vLLM's Generative Scoring API (POST /generative_scoring, issue 45) on the tiny model: vLLM's response shape, scores
that are the labels' next-token probabilities transformers computes from the same model's logits (normalised over
the labels, or over the vocabulary with apply_softmax false), item_first and token-id inputs, and every bad input a
400 naming its field before anything runs."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.utils import RemoteServer

MODEL = "tiny"
QUERY = "Is this city the capital of France? Answer Yes or No: "
ITEMS = ["Paris", "London is rainy.", "Berlin"]


@pytest.fixture(scope="module")
def url(server: RemoteServer) -> str:
    return f"{server.url}/generative_scoring"


@pytest.fixture(scope="module")
def next_logprobs(tiny_llm_dir: Path) -> Any:
    """Prompt ids -> transformers' log-softmax of the tiny model's logits at the position after them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llm_dir, dtype=torch.float32).eval()

    def read(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)

    return read


def _post(url: str, **body: Any) -> httpx.Response:
    return httpx.post(url, json={"model": MODEL, **body}, timeout=60)


def _scores(url: str, **body: Any) -> list[float]:
    reply = _post(url, **body)
    assert reply.status_code == 200, reply.text
    return [d["score"] for d in reply.json()["data"]]


def test_scores_are_the_models_label_probabilities(url: str, tokenizer: Any, next_logprobs: Any) -> None:
    """vLLM's shape (id, object "list", data of index / "score" / score, usage); each score is the first label's
    probability after query + item, softmaxed over the labels from transformers' logits, in [0, 1]; the labels'
    scores (each put first in turn) sum to 1; apply_softmax false gives the model's own probability."""
    labels = [tokenizer.encode(w, add_special_tokens=False)[0] for w in (" Yes", " No", " Maybe")]
    reply = _post(url, query=QUERY, items=ITEMS, label_token_ids=labels)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["id"].startswith("generative-scoring-") and body["object"] == "list" and body["model"] == MODEL
    assert [(d["index"], d["object"]) for d in body["data"]] == [(i, "score") for i in range(len(ITEMS))]
    prompts = [tokenizer.encode(QUERY) + tokenizer.encode(item, add_special_tokens=False) for item in ITEMS]
    usage = body["usage"]
    assert usage["prompt_tokens"] == sum(map(len, prompts)) and usage["completion_tokens"] == len(ITEMS)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    raw = [_scores(url, query=QUERY, items=ITEMS, label_token_ids=labels, apply_softmax=False)]
    rotations = [labels[k:] + labels[:k] for k in range(len(labels))]
    each = [[d["score"] for d in body["data"]]] + [_scores(url, query=QUERY, items=ITEMS, label_token_ids=r)
                                                   for r in rotations[1:]]
    for i, ids in enumerate(prompts):
        logprobs = next_logprobs(ids)[labels]
        want = logprobs.softmax(-1)
        got = torch.tensor([each[k][i] for k in range(len(labels))])  # label k's score: rotation k's first
        assert torch.allclose(got, want, atol=1e-4), (got, want)
        assert all(0.0 <= s <= 1.0 for s in got) and abs(float(got.sum()) - 1.0) < 1e-5
        assert abs(raw[0][i] - float(logprobs[0].exp())) < 1e-5


def test_token_ids_item_first_and_salt(url: str, next_logprobs: Any) -> None:
    """Token-id query and items, concatenated query + item or (item_first) item + query; a repeated label is read
    once; a cache_salt changes nothing in the scores; the same request twice scores the same."""
    query, items, labels = [5, 17, 230, 45], [[9, 300], [1000, 7, 8]], [11, 12, 11]
    for item_first in (False, True):
        got = _scores(url, query=query, items=items, label_token_ids=labels, item_first=item_first)
        for i, item in enumerate(items):
            ids = item + query if item_first else query + item
            want = float(next_logprobs(ids)[[11, 12]].softmax(-1)[0])
            assert abs(got[i] - want) < 1e-4
        salted = _scores(url, query=query, items=items, label_token_ids=labels, item_first=item_first,
                         cache_salt="tenant-a")
        assert salted == pytest.approx(got, abs=1e-6)
    assert _scores(url, query=query, items=items, label_token_ids=[11, 12]) == \
        pytest.approx(_scores(url, query=query, items=items, label_token_ids=[11, 12]), abs=1e-6)


def test_request_id_names_the_response(url: str) -> None:
    """vLLM's request_id: the response's id is generative-scoring-<request_id>."""
    reply = _post(url, query="q", items=["a"], label_token_ids=[11, 12], request_id="mine-1")
    assert reply.status_code == 200 and reply.json()["id"] == "generative-scoring-mine-1"


@pytest.mark.parametrize("body,param", [
    ({"query": "q", "items": ["a"]}, "label_token_ids"),
    ({"query": "q", "items": ["a"], "label_token_ids": []}, "label_token_ids"),
    ({"query": "q", "items": ["a"], "label_token_ids": [9999999999, 9999999998]}, "label_token_ids"),
    ({"query": "q", "items": ["a"], "label_token_ids": [-1, 2]}, "label_token_ids"),
    ({"query": "q", "items": ["a"], "label_token_ids": list(range(129))}, "label_token_ids"),
    ({"query": "q", "items": ["a"], "label_token_ids": [True, 2]}, "label_token_ids[0]"),
    ({"query": "q", "items": [], "label_token_ids": [1, 2]}, "items"),
    ({"query": "q", "items": ["a"] * 1025, "label_token_ids": [1, 2]}, "items"),
    ({"query": "q", "items": ["a", [1, 2]], "label_token_ids": [1, 2]}, "items"),
    ({"query": [1, 2], "items": [[3, 10 ** 9]], "label_token_ids": [1, 2]}, "items[0]"),
    ({"query": [1, -2], "items": [[3]], "label_token_ids": [1, 2]}, "query"),
    ({"query": [1] * 300, "items": [[2] * 212], "label_token_ids": [1, 2]}, "items[0]"),
    ({"query": [1] * 512, "items": ["a"], "label_token_ids": [1, 2]}, "query"),
    ({"query": "t " * 600, "items": ["a"], "label_token_ids": [1, 2]}, "items[0]"),
    ({"query": "q", "items": ["x" * 40000], "label_token_ids": [1, 2]}, "items[0]"),
    ({"query": "", "items": [""], "label_token_ids": [1, 2], "add_special_tokens": False}, "items[0]"),
    ({"query": "q", "items": ["a"], "label_token_ids": [1, 2], "priority": 1}, "priority"),
    ({"query": "q", "items": ["a"], "label_token_ids": [1, 2], "cache_salt": ""}, "cache_salt"),
    ({"query": "q", "items": ["a"], "label_token_ids": [1, 2], "cache_salt": "a/b"}, "cache_salt"),
    ({"query": "q", "items": ["a"], "label_token_ids": [1, 2], "request_id": "r" * 257}, "request_id"),
    ({"query": "q", "items": ["a"], "label_token_ids": [1, 2], "apply_softmax": "yes"}, "apply_softmax"),
    ({"query": "q", "items": ["a"], "label_token_ids": [1, 2], "temperature": 0}, "temperature"),
], ids=["no-labels", "empty-labels", "labels-out-of-vocab", "negative-label", "129-labels", "bool-label",
        "no-items", "1025-items", "mixed-items", "item-id-out-of-vocab", "query-id-negative", "ids-too-long",
        "query-ids-too-long", "text-too-long", "text-over-byte-cap", "empty-prompt", "priority", "empty-salt",
        "salt-slash", "long-request-id", "lax-bool", "unknown-field"])
def test_bad_input_is_a_400_naming_the_field(url: str, body: dict, param: str) -> None:
    """Each client-controlled size and value is checked before anything is queued: a 400 (vLLM's error type,
    BadRequestError) naming the field."""
    reply = _post(url, **body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError", error


def test_unknown_model_is_a_404(url: str) -> None:
    reply = httpx.post(url, json={"model": "nope", "query": "q", "items": ["a"], "label_token_ids": [1, 2]})
    assert reply.status_code == 404


def test_label_probabilities() -> None:
    """vLLM's formula: a softmax over the labels alone, stable for very small log-probabilities (sums to 1);
    apply_softmax false: each label's own exp (below 1 together); labels that all cannot be chosen share it."""
    import math

    from pagedllm.entrypoints.openai.serving_generative_scoring import label_probabilities

    got = label_probabilities([-0.5, -2.0], True)
    assert got[0] == pytest.approx(math.exp(-0.5) / (math.exp(-0.5) + math.exp(-2.0))) and sum(got) == \
        pytest.approx(1.0)
    assert sum(label_probabilities([-1000.0, -1000.5], True)) == pytest.approx(1.0)
    raw = label_probabilities([-1.0, -2.0], False)
    assert raw == pytest.approx([math.exp(-1.0), math.exp(-2.0)]) and sum(raw) < 1.0
    assert label_probabilities([float("-inf")] * 4, True) == [0.25] * 4
