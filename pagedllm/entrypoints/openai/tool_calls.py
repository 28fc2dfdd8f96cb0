"""Tool calling on /v1/chat/completions: what each ``tool_choice`` constrains, and the parsers that
find a model's own tool calls in its reply (``--tool-call-parser``, for ``tool_choice="auto"``).

- ``"required"``: the reply is constrained (structured outputs) to a JSON array of one or more
  ``{"name": <a tool's name>, "parameters": <that tool's schema>}``: it always parses.
- a named function: the reply is constrained to that function's parameters schema.
- ``"auto"``: the model writes what it wants; the server's parser turns its tool-call format
  into ``tool_calls`` (``hermes``: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, the
  format of Hermes / Qwen 2.5 / Qwen 3; ``llama3_json``: a JSON object ``{"name": ...,
  "parameters": ...}`` as the whole reply, several separated by ``;``).
- ``"none"``: tools are shown to the model (the chat template) but no call is parsed.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pagedllm.errors import ValidationError
from pagedllm.sampling_params import StructuredOutputsParams


@dataclass
class ParsedCall:
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's shape)."""


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_functions(tools: list[dict] | None) -> list[dict]:
    """The ``function`` objects of ``tools`` (each checked to have a name and object parameters)."""
    functions = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValidationError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                                  param=f"tools[{i}]")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValidationError.bad_value(f"tools[{i}].function.parameters", params, "a JSON schema object")
        functions.append({**fn, "parameters": params})
    return functions


def constraint(tool_choice: Any, functions: list[dict], parallel: bool = True
               ) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the structured-output constraint of ``tool_choice``, the one named function or None);
    ``parallel`` false: "required" allows one call only."""
    if tool_choice in (None, "none", "auto"):
        return None, None
    if not functions:
        raise ValidationError("tool_choice needs tools", param="tool_choice", value=tool_choice)
    if tool_choice == "required":
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                  "properties": {"name": {"enum": [fn["name"]]}, "parameters": fn["parameters"]}}
                 for fn in functions]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema), None
    if isinstance(tool_choice, dict):  # the raw shape (offline callers); the server hands a NamedToolChoice
        name = (tool_choice.get("function") or {}).get("name")
    else:
        name = getattr(getattr(tool_choice, "function", None), "name", None)
    match = [fn for fn in functions if fn["name"] == name]
    if not match:
        raise ValidationError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice",
                              value=name)
    return StructuredOutputsParams(json=match[0]["parameters"]), name


def constrained_calls(text: str, named: str | None) -> list[ParsedCall]:
    """The calls of a reply written under ``constraint`` (it parses: the grammar made sure)."""
    if named is not None:
        return [ParsedCall(named, json.dumps(json.loads(text)))]
    return [ParsedCall(call["name"], json.dumps(call["parameters"])) for call in json.loads(text)]


class ToolParser:
    """Finds a model's own tool calls in its reply: (content left, calls)."""

    name = ""

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        calls = []
        for body in self._CALL.findall(text):
            try:
                call = json.loads(body)
            except json.JSONDecodeError:
                return text, []  # not a well-formed call: the reply stays text
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return text, []
            calls.append(ParsedCall(call["name"], json.dumps(call.get("arguments", {}))))
        if not calls:
            return text, []
        content = text[:text.index("<tool_call>")].strip()
        return content or None, calls


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        stripped = text.strip().removeprefix("<|python_tag|>")
        if not stripped.startswith("{"):
            return text, []
        calls = []
        for part in stripped.split(";"):
            try:
                call = json.loads(part)
            except json.JSONDecodeError:
                return text, []
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return text, []
            calls.append(ParsedCall(call["name"], json.dumps(call.get("parameters", call.get("arguments", {})))))
        return None, calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}


def get_tool_parser(name: str | None) -> ToolParser | None:
    """The parser named ``name`` (None: none); an unknown name is a ValueError listing them."""
    if name is None:
        return None
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
