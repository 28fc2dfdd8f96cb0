"""Structured outputs (xgrammar) on the tiny random model: every reply follows its constraint."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams, ValidationError

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
    worker = engine.engine_core.core.executor.worker  # the in-process (uni) executor's
    compiler = engine.engine_core.core.processor.grammars()
    assert worker.model_runner.grammars() is compiler
    assert compiler.cache_bytes == engine.config.structured_outputs.grammar_cache_bytes
    llm.generate("Pick:", _params(StructuredOutputsParams(choice=["a fresh choice", "another one"])), use_tqdm=False)
    assert compiler.cached_bytes() > 0
