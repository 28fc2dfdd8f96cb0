"""Structured outputs (xgrammar) on the tiny random model: every reply follows its constraint."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams, ValidationError
from tests.utils import worker_of

LLM_OPTIONS = dict(num_kv_blocks=256)
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city"],
                                     "properties": {"city": {"enum": ["Paris", "Rome"]}}},
                         "ok": {"type": "boolean"}}}


def _params(spec: StructuredOutputsParams, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 120, "temperature": 1.0, "structured_outputs": spec, **kw})


def test_json_schema_replies_validate(llm: LLM) -> None:
    outs = llm.generate([f"Person {i}:" for i in range(6)], _params(StructuredOutputsParams(json=PERSON), seed=5),
                        use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    # any object: a random model may write one string until max_tokens; what it wrote is an object's start
    any_obj = llm.generate("Anything:", _params(StructuredOutputsParams(json_object=True), seed=1), use_tqdm=False)
    text = any_obj[0].outputs[0].text
    assert text.startswith("{") and (any_obj[0].outputs[0].finish_reason != "stop"
                                     or isinstance(json.loads(text), dict))


def test_choice_and_regex_hold_on_every_sample(llm: LLM) -> None:
    choice = llm.generate("Pick:", _params(StructuredOutputsParams(choice=["yes", "no", "maybe"]), n=4, seed=2),
                          use_tqdm=False)[0]
    assert len(choice.outputs) == 4 and all(c.text in ("yes", "no", "maybe") for c in choice.outputs)
    regex = llm.generate("Call:", _params(StructuredOutputsParams(regex=r"\(\d{3}\) \d{3}-\d{4}"), n=4, seed=3),
                         use_tqdm=False)[0]
    assert all(re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", c.text) for c in regex.outputs), [c.text for c in regex.outputs]


def test_constrained_and_free_requests_share_a_step(llm: LLM) -> None:
    free = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    alone = llm.generate("Free text:", free, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate(["Free text:", "Pick:"], [free, _params(StructuredOutputsParams(choice=["on", "off"]))],
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone  # the unconstrained row is untouched by the other's mask
    assert outs[1].outputs[0].text in ("on", "off")


def test_constraints_survive_preemption(make_llm) -> None:
    small = make_llm(num_kv_blocks=12, max_num_seqs=6)  # 6 requests x ~60 tokens need more: preemption
    outs = small.generate([f"Person {i}:" for i in range(6)], _params(StructuredOutputsParams(json=PERSON), seed=9),
                          use_tqdm=False)
    assert small.get_stats().num_preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)


@pytest.mark.parametrize("spec, param", [
    (dict(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}), "structured_outputs.json"),
    (dict(regex="(unclosed"), "structured_outputs.regex"),
    (dict(grammar="root ::= "), "structured_outputs.grammar"),
    (dict(regex="a", choice=["b"]), "structured_outputs"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(json={"$ref": "https://example.com/schema.json"}), "structured_outputs.json"),
    (dict(json={"type": "object", "properties": {"a": {"$ref": "file:///etc/passwd"}}}), "structured_outputs.json"),
    (dict(json='{"$defs": {}, "items": [{"$ref": 3}]}'), "structured_outputs.json"),
])
def test_bad_constraints_name_the_field(llm: LLM, spec: dict, param: str) -> None:
    with pytest.raises(ValidationError) as e:
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(**spec)), use_tqdm=False)
    assert e.value.param == param


def test_local_refs_are_followed(llm: LLM) -> None:
    schema = {"$defs": {"city": {"enum": ["Paris", "Rome"]}}, "type": "object", "additionalProperties": False,
              "required": ["city"], "properties": {"city": {"$ref": "#/$defs/city"}}}
    out = llm.generate("City:", _params(StructuredOutputsParams(json=schema), seed=3), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert json.loads(out.text)["city"] in ("Paris", "Rome")


def test_the_processor_and_an_in_process_worker_share_one_grammar_cache(llm: LLM) -> None:
    engine = llm.llm_engine
    worker = worker_of(engine)  # the in-process (uni) executor's
    compiler = engine.engine_core.core.request_factory.grammars()
    assert worker.model_runner.grammars() is compiler
    assert compiler.cache_bytes == engine.config.structured_outputs.grammar_cache_bytes
    llm.generate("Pick:", _params(StructuredOutputsParams(choice=["a fresh choice", "another one"])), use_tqdm=False)
    assert compiler.cached_bytes() > 0


# grammar_after_reasoning (vLLM's structured outputs with a reasoning parser): the reply starts inside its
# reasoning; the grammar sleeps until the end marker, then holds what follows. "<think>" / "</think>" in the
# default tokenizer, as tests/engine/test_sampling_fields.py's thinking budget uses them.
THINK, END_THINK = [44, 17400, 46], [9617, 17400, 46]
THINKING_PROMPT = {"prompt_token_ids": [1, 520, 9531, 198, *THINK, 198]}


def _after_reasoning(spec: StructuredOutputsParams, budget: int = 4, **kw) -> SamplingParams:
    """A grammar after a reasoning the thinking budget ends (the tiny model never writes the end marker itself)."""
    return _params(spec, grammar_after_reasoning=True, thinking_token_budget=budget, reasoning_start_token_ids=THINK,
                   reasoning_end_token_ids=END_THINK, **kw)


def _content(tokenizer, token_ids: list[int]) -> str:
    """The text of the output's tokens after its first end marker (the test fails without one)."""
    at = next(i for i in range(len(token_ids)) if list(token_ids[i:i + len(END_THINK)]) == END_THINK)
    return tokenizer.decode(list(token_ids[at + len(END_THINK):]), skip_special_tokens=True)


def test_grammar_sleeps_through_the_reasoning_then_holds(llm: LLM, tokenizer) -> None:
    """The reasoning's tokens are those of the unconstrained model (no mask while it lasts), the forced end marker
    follows, and after it the grammar holds (the whole rest parses); without grammar_after_reasoning the grammar
    holds from the first token, so the reply can never reach the end marker."""
    choices = ["yes", "no", "maybe"]
    spec = StructuredOutputsParams(choice=choices)
    free = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    reasoning = llm.generate([THINKING_PROMPT], free, use_tqdm=False)[0].outputs[0].token_ids
    out = llm.generate([THINKING_PROMPT], _after_reasoning(spec, temperature=0.0), use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids[:3]) == list(reasoning) and list(out.token_ids[3:6]) == END_THINK, out.token_ids
    assert _content(tokenizer, out.token_ids) in choices and out.finish_reason == "stop"
    held = llm.generate([THINKING_PROMPT], _params(spec, temperature=0.0), use_tqdm=False)[0].outputs[0]
    assert held.text in choices
    for out in llm.generate([THINKING_PROMPT], _after_reasoning(StructuredOutputsParams(json=PERSON), seed=4, n=3),
                            use_tqdm=False)[0].outputs:
        jsonschema.validate(json.loads(_content(tokenizer, out.token_ids)), PERSON)


def test_grammar_after_reasoning_survives_preemption(make_llm, tokenizer) -> None:
    """Recompute preemption rebuilds each matcher from the output so far: asleep before the end marker, fed only
    what follows it after; every reply's content still validates."""
    small = make_llm(num_kv_blocks=12, max_num_seqs=6)
    outs = small.generate([THINKING_PROMPT] * 6, _after_reasoning(StructuredOutputsParams(json=PERSON), budget=6,
                                                                  seed=9), use_tqdm=False)
    assert small.get_stats().num_preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(_content(tokenizer, out.outputs[0].token_ids)), PERSON)


def test_a_matcher_rebuilt_from_the_output_reads_what_follows_the_reasoning(llm: LLM, tokenizer) -> None:
    """reasoning_end and Matcher.readable: a resumed request's matcher is fed only the tokens after the end marker
    (asleep if there is none yet); the implicit ends the grammar cannot start with are banned while it sleeps; and
    speculative rows that cross the marker are masked from the token after it, no earlier."""
    import torch

    from pagedllm.worker.structured_output import apply_draft_masks, reasoning_end

    assert reasoning_end([5, *END_THINK, 7], [END_THINK]) == (4, 4)
    assert reasoning_end([5, *END_THINK, 7], [END_THINK], since=4) is None  # the marker ended before ``since``
    assert reasoning_end([5, END_THINK[0], END_THINK[1]], [END_THINK], since=2) is None  # not whole yet
    assert reasoning_end([5, 8, *END_THINK], [END_THINK], implicit={8}) == (1, 2)  # the first end wins
    compiler = llm.llm_engine.engine_core.core.request_factory.grammars()
    spec = StructuredOutputsParams(choice=["yes", "no"])
    yes, other = tokenizer.encode("yes", add_special_tokens=False), tokenizer.encode("{", add_special_tokens=False)
    thinking = [5, 6, 7]
    asleep = compiler.matcher(spec, thinking, [END_THINK], implicit_ends=[yes[0], other[0]])
    assert asleep.reasoning and asleep.reasoning_banned.tolist() == [other[0]]  # "yes" may start the content
    awake = compiler.matcher(spec, thinking + END_THINK + yes, [END_THINK])
    assert not awake.reasoning and not awake.accept_token(other[0])  # it read "yes": only the end may follow
    vocab = len(tokenizer)
    drafts = [8, *END_THINK, *yes]  # row j scores the token after drafts[:j]: rows 0-3 reason, 4 on are the grammar's
    logits, allowed = apply_draft_masks(torch.zeros(len(drafts) + 1, vocab), [(0, asleep, drafts, thinking)])
    masked = torch.isinf(logits).sum(-1).tolist()
    assert masked[:4] == [1, 1, 1, 1] and all(m > vocab // 2 for m in masked[4:]), masked
    assert logits[4, yes[0]] == 0 and allowed == [len(drafts)]
    assert asleep.reasoning and asleep.readable(thinking, 3) == []  # (masking drafts leaves it as it was)
    assert asleep.readable(thinking + [8, *END_THINK, yes[0]], 5) == [yes[0]] and not asleep.reasoning
