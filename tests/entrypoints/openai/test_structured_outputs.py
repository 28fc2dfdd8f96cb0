"""Structured outputs through the official openai client: JSON schemas (nested objects, enums,
arrays, required fields) streamed and not, choice and regex on every one of n=4 samples."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

MODEL = "tiny"


def _schema(i: int) -> dict:
    """20 different schemas: nested objects, enums, arrays, booleans, bounded strings and integers."""
    colors = ["red", "green", "blue", "black"][: 2 + i % 3]
    item = {"type": "object", "additionalProperties": False, "required": ["id", "color"],
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99 + i},
                           "color": {"enum": colors}}}
    props = {f"field{i}": {"type": "string", "maxLength": 4 + i % 5},
             "items": {"type": "array", "items": item, "maxItems": 1 + i % 3},
             "flag": {"type": "boolean"},
             "meta": {"type": "object", "additionalProperties": False, "required": ["level"],
                      "properties": {"level": {"enum": ["low", "high"]}}}}
    return {"type": "object", "additionalProperties": False, "properties": props,
            "required": sorted(props) if i % 2 else [f"field{i}", "meta"]}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_replies_parse_and_validate(client: openai.OpenAI, stream: bool) -> None:
    for i in range(10):
        schema = _schema(2 * i + stream)
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        args = dict(model=MODEL, messages=[{"role": "user", "content": f"Reply {i} in JSON"}], max_tokens=200,
                    temperature=1.0, seed=i, response_format=fmt)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **args)
                           if c.choices)
        else:
            reply = client.chat.completions.create(**args).choices[0]
            assert reply.finish_reason == "stop"
            text = reply.message.content
        jsonschema.validate(json.loads(text), schema)


def test_choice_and_regex_on_every_sample(client: openai.OpenAI) -> None:
    choices = ["alpha", "beta", "gamma"]
    out = client.completions.create(model=MODEL, prompt="Pick one:", n=4, max_tokens=8, temperature=1.0, seed=1,
                                    extra_body={"structured_outputs": {"choice": choices}})
    assert len(out.choices) == 4 and all(c.text in choices for c in out.choices)
    pattern = r"[A-Z]{2}-\d{3}"
    out = client.completions.create(model=MODEL, prompt="Code:", n=4, max_tokens=12, temperature=1.0, seed=2,
                                    extra_body={"structured_outputs": {"regex": pattern}})
    assert all(re.fullmatch(pattern, c.text) for c in out.choices), [c.text for c in out.choices]


def test_bad_schema_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "bad", "schema": {"type": "object", "properties": {
                                               "a": {"type": "not-a-type"}}}}})
    assert "structured_outputs.json" in str(e.value)
