"""vLLM's structured decisions (POST /v1/decisions and POST /v1/systemone, issue 45) on the tiny model: vLLM's
response shapes, label probabilities that sum to 1 and are the softmax over the labels' tokens of the logits
transformers computes for the same chat prompt, and every bad input a 400 naming what is wrong before anything
runs."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.utils import RemoteServer

MODEL = "tiny"
INPUT = "The package arrived with a broken screen."
QUESTIONS = [
    {"type": "predicate", "instructions": "Is the screen broken?"},
    {"type": "choice", "name": "department", "instructions": "Which department should handle this?",
     "choices": [{"value": "returns"}, {"value": "billing", "description": "money matters"}, {"value": True}]},
    {"type": "score", "name": "damage", "instructions": "Rate the damage.",
     "levels": [{"label": "undamaged"}, {"label": "scratched"}, {"label": "broken"}]},
]


@pytest.fixture(scope="module")
def base(server: RemoteServer) -> str:
    return server.url


@pytest.fixture(scope="module")
def next_logprobs(tiny_llm_dir: Path) -> Any:
    """Prompt ids -> transformers' log-softmax of the tiny model's logits at the position after them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llm_dir, dtype=torch.float32).eval()

    def read(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)

    return read


def _post(base: str, path: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{base}{path}", json={"model": MODEL, **body}, timeout=60)


def _prompt(tokenizer: Any, content: str, system: str | None = None) -> list[int]:
    messages = [{"role": "user", "content": content}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    return tokenizer.encode(text, add_special_tokens=False)


def _label(tokenizer: Any, label: str) -> int:
    """The token ``label`` adds after the chat prompt's "assistant\\n" tail."""
    tail = tokenizer.encode("assistant\n", add_special_tokens=False)
    return tokenizer.encode("assistant\n" + label, add_special_tokens=False)[len(tail)]


def test_decisions_shape_and_probabilities(base: str, tokenizer: Any, next_logprobs: Any) -> None:
    """vLLM's body (model, answers, usage and nothing else); each answer of its question's type, its name echoed;
    the probabilities sum to 1; a choice is the likeliest value, a score the expected level; usage counts every
    question's prompt and one output token each; the choice question's probabilities are the softmax over A, B, C
    of transformers' logits for the prompt the server renders."""
    reply = _post(base, "/v1/decisions", input=INPUT, questions=QUESTIONS)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert set(body) == {"model", "answers", "usage"} and body["model"] == MODEL
    predicate, choice, score = body["answers"]
    assert predicate["type"] == "predicate" and predicate["name"] is None and 0 <= predicate["probability"] <= 1
    assert choice["type"] == "choice" and choice["name"] == "department"
    assert [p["value"] for p in choice["probabilities"]] == ["returns", "billing", True]
    assert sum(p["probability"] for p in choice["probabilities"]) == pytest.approx(1)
    assert choice["choice"] == max(choice["probabilities"], key=lambda p: p["probability"])["value"]
    assert 0 < choice["confidence"] <= max(p["probability"] for p in choice["probabilities"])
    assert score["type"] == "score" and score["name"] == "damage"
    assert [(p["value"], p["label"]) for p in score["probabilities"]] == [(0, "undamaged"), (1, "scratched"),
                                                                         (2, "broken")]
    assert score["score"] == pytest.approx(sum(p["value"] * p["probability"] for p in score["probabilities"]))
    assert sum(p["probability"] for p in score["probabilities"]) == pytest.approx(1)

    content = (f"{INPUT}\n\nQuestion: Which department should handle this?\nA: \"returns\"\n"
               "B: \"billing\" - money matters\nC: true\nAnswer with the letter of one option only.")
    ids = _prompt(tokenizer, content)
    logprobs = next_logprobs(ids)[[_label(tokenizer, c) for c in "ABC"]]
    want = logprobs.softmax(-1)
    got = torch.tensor([p["probability"] for p in choice["probabilities"]])
    assert torch.allclose(got, want, atol=1e-4), (got, want)
    assert choice["confidence"] == pytest.approx(float(want.max() * logprobs.exp().sum()), abs=1e-5)

    usage = body["usage"]
    assert usage["output_tokens"] == 3 and usage["total_tokens"] == usage["input_tokens"] + 3
    assert usage["input_tokens"] > 3 * len(ids) // 2  # (three prompts about as long as this one)
    assert set(usage["input_tokens_details"]) == {"cached_tokens", "cache_write_tokens"}
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}


def test_decisions_message_input(base: str) -> None:
    """Messages of text parts read as the same text as the string (blank lines between messages): same answer."""
    question = [QUESTIONS[0]]
    one = _post(base, "/v1/decisions", input="First.\n\nSecond\nthird", questions=question)
    two = _post(base, "/v1/decisions", questions=question, cache_salt="s1", input=[
        {"role": "user", "content": "First."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Second"},
                                                         {"type": "input_text", "text": "third"}]}])
    assert one.status_code == 200 and two.status_code == 200, (one.text, two.text)
    a, b = one.json(), two.json()
    assert a["answers"][0]["probability"] == pytest.approx(b["answers"][0]["probability"], abs=1e-5)
    assert a["usage"]["input_tokens"] == b["usage"]["input_tokens"]


def test_systemone_types(base: str, tokenizer: Any, next_logprobs: Any) -> None:
    """vLLM's structured decision body: id, object, answers and diagnostics by id in the request's order; a choice
    (one option: certain, its confidence the label's own mass), a noul (yes/no) and a score (legend, 0-indexed
    expected level); the noul's probabilities and label_mass agree with transformers' logits for its prompt, which
    carries the system instructions and the state as JSON."""
    questions = {
        "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None}},
        "urgent": {"type": "noul", "instructions": "Is money moving?", "criteria": {"true": "money moves"}},
        "tone": {"type": "score", "criteria": ["calm", "annoyed", "furious"]},
    }
    state = {"ticket": "Charged twice.", "n": 2}
    reply = _post(base, "/v1/systemone", state=state, questions=questions, instructions="Be brief.",
                  chat_template_kwargs={"enable_thinking": False}, request_id="abc")
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["id"] == "decision-abc" and body["object"] == "structured_decision" and body["model"] == MODEL
    assert body["joint"] is None and list(body["answers"]) == ["team", "urgent", "tone"]
    assert list(body["diagnostics"]) == ["team", "urgent", "tone"]
    team, urgent, tone = (body["answers"][k] for k in ("team", "urgent", "tone"))
    diag = body["diagnostics"]
    assert team == {"type": "choice", "choice": "billing", "probabilities": {"billing": 1.0},
                    "confidence": pytest.approx(diag["team"]["label_mass"])}
    assert urgent["type"] == "noul" and urgent["noul"] == urgent["probabilities"]["yes"]
    assert urgent["probabilities"]["yes"] + urgent["probabilities"]["no"] == pytest.approx(1)
    assert urgent["confidence"] == pytest.approx(max(urgent["probabilities"].values()) * diag["urgent"]["label_mass"])
    assert tone["type"] == "score" and tone["legend"] == {"0": "calm", "1": "annoyed", "2": "furious"}
    assert sum(tone["probabilities"].values()) == pytest.approx(1)
    assert tone["score"] == pytest.approx(sum(i * p for i, p in enumerate(tone["probabilities"].values())))
    assert all(0 < d["label_mass"] <= 1 + 1e-6 and isinstance(d["argmax_is_label"], bool) for d in diag.values())
    assert body["usage"]["output_tokens"] == 3 and body["usage"]["input_tokens"] > 0

    content = ('{"ticket": "Charged twice.", "n": 2}\n\nQuestion: Is money moving?\nyes: money moves\nno\n'
               "Answer with yes or no only.")
    logprobs = next_logprobs(_prompt(tokenizer, content, system="Be brief."))[
        [_label(tokenizer, "yes"), _label(tokenizer, "no")]]
    want = logprobs.softmax(-1)
    assert urgent["probabilities"]["yes"] == pytest.approx(float(want[0]), abs=1e-4)
    assert diag["urgent"]["label_mass"] == pytest.approx(float(logprobs.exp().sum()), rel=1e-3)


def test_option_limits(base: str) -> None:
    """26 lettered options are read; the 27th is a 400 (both routes); a score takes 10 levels at most."""
    ok = _post(base, "/v1/systemone", state="x",
               questions={"n": {"type": "choice", "criteria": dict.fromkeys(map(str, range(26)))}})
    assert ok.status_code == 200, ok.text
    probs = ok.json()["answers"]["n"]["probabilities"]
    assert len(probs) == 26 and math.isclose(sum(probs.values()), 1, abs_tol=1e-4)
    over = _post(base, "/v1/systemone", state="x",
                 questions={"n": {"type": "choice", "criteria": dict.fromkeys(map(str, range(27)))}})
    assert over.status_code == 400 and "at most 26 options" in over.json()["error"]["message"]
    levels = _post(base, "/v1/systemone", state="x",
                   questions={"s": {"type": "score", "criteria": list("abcdefghijk")}})
    assert levels.status_code == 400 and "at most 10 options" in levels.json()["error"]["message"]
    choices = [{"value": str(i)} for i in range(27)]
    over = _post(base, "/v1/decisions", input="x", questions=[{"type": "choice", "instructions": "?",
                                                              "choices": choices}])
    assert over.status_code == 400 and "at most 26 choices" in over.json()["error"]["message"]


PRED = {"type": "predicate", "instructions": "?"}
CHOICE = {"type": "choice", "criteria": {"a": None, "b": None}}


@pytest.mark.parametrize("path,body,match", [
    ("/v1/decisions", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
                       "questions": [PRED]}, "text input only"),
    ("/v1/decisions", {"input": "x", "questions": [PRED] * 65}, "at most 64"),
    ("/v1/decisions", {"input": "x", "questions": [PRED] * 201}, "questions"),
    ("/v1/decisions", {"input": "x", "questions": []}, "questions"),
    ("/v1/decisions", {"input": "x", "questions": [PRED], "joint": True}, "joint"),
    ("/v1/decisions", {"input": "x", "questions": [PRED], "cache_salt": "a/b"}, "cache_salt"),
    ("/v1/decisions", {"input": "x", "questions": [PRED], "temperature": 1}, "temperature"),
    ("/v1/decisions", {"input": "x", "questions": [{**PRED, "name": None}]}, "name"),
    ("/v1/decisions", {"input": "x", "questions": [{"type": "choice", "instructions": "?",
                                                    "choices": [{"value": "a"}, {"value": "a"}]}]}, "must all differ"),
    ("/v1/decisions", {"input": "x", "questions": [{"type": "score", "instructions": "?",
                                                    "levels": [{"label": "a"}]}]}, "levels"),
    ("/v1/systemone", {"state": "x", "questions": {"q": {**CHOICE, "depends_on": ["x"]}}}, "unknown field(s)"),
    ("/v1/systemone", {"state": "x", "questions": {f"q{i}": CHOICE for i in range(65)}}, "at most 64"),
    ("/v1/systemone", {"state": "x", "questions": {}}, "at least one question"),
    ("/v1/systemone", {"state": "x", "questions": {"q": {"type": "noul", "criteria": ["yes", "no"]}}},
     "must be an object"),
    ("/v1/systemone", {"state": "x", "questions": {"q": {"type": "score", "criteria": ["calm"]}}},
     "ordered list of levels"),
    ("/v1/systemone", {"state": "x", "questions": {"q": {"type": "rank", "criteria": ["a"]}}}, "the types are"),
    ("/v1/systemone", {"state": "x", "questions": {"q": CHOICE}, "chat_template_kwargs": {"enable_thinking": True}},
     "thinking must be off"),
    ("/v1/systemone", {"state": "x", "questions": {"q": CHOICE},
                       "chat_template_kwargs": {"chat_template": "{{ 6 * 7 }}"}}, "--trust-request-chat-template"),
    ("/v1/systemone", {"state": "x", "questions": {"q": CHOICE}, "images": ["http://x/y.png"]}, "text only"),
    ("/v1/systemone", {"state": "x", "questions": {"q": CHOICE}, "joint": True}, "joint"),
    ("/v1/systemone", {"state": "x", "questions": {"q": CHOICE}, "priority": 3}, "priority"),
    ("/v1/systemone", {"state": "word " * 3000, "questions": {"q": CHOICE}}, "max_model_len"),
])
def test_bad_input_is_a_400(base: str, path: str, body: dict, match: str) -> None:
    reply = _post(base, path, **body)
    assert reply.status_code == 400, reply.text
    assert match in reply.json()["error"]["message"], reply.text


def test_unknown_model_is_a_404(base: str) -> None:
    reply = httpx.post(f"{base}/v1/decisions", json={"model": "nope", "input": "x", "questions": [PRED]}, timeout=60)
    assert reply.status_code == 404, reply.text


def test_labels_that_are_not_one_token_make_the_model_unsupported(tokenizer: Any) -> None:
    """The labels' tokens come from the model's own chat prompt: found for the default model's template; a model
    without a chat template, or whose labels merge with the prompt's tail, cannot answer (the routes' 501)."""
    from pagedllm.entrypoints.openai.serving_decisions import LETTERS, OpenAIServingDecisions

    def reader(tok: Any, template: str | None = None) -> OpenAIServingDecisions:
        serving = OpenAIServingDecisions.__new__(OpenAIServingDecisions)  # (no engine: only the tokenizer is read)
        serving.tokenizer, serving.chat_template = tok, template
        return serving

    tail, ids = reader(tokenizer)._find_labels()
    assert tokenizer.decode(tail) == "assistant\n" and len(set(ids[c] for c in LETTERS)) == 26
    assert ids["yes"] == _label(tokenizer, "yes") and len(ids) == 26 + 2 + 10
    glued = "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}Answer: {% endif %}"
    assert "is not one distinct token" in reader(tokenizer, glued)._find_labels()  # (" A" is one token)


def test_question_text() -> None:
    """How options are written: "A: name", "A: name - description"; a noul's side as its label, or with what it
    means; the reply instruction of the type last; no Question line without instructions."""
    from pagedllm.entrypoints.openai.serving_decisions import parse_spec

    choice = parse_spec("q", "choice", "Which?", {"a": None, "b": "the second"})
    assert choice.text() == "Question: Which?\nA: a\nB: b - the second\nAnswer with the letter of one option only."
    noul = parse_spec("q", "noul", None, {"false": "it is not"})
    assert noul.text() == "yes\nno: it is not\nAnswer with yes or no only."
    score = parse_spec("q", "score", {"k": 1}, ["low", 2])
    assert score.text() == 'Question: {"k": 1}\n0: low\n1: 2\nAnswer with the number of one level only.'
