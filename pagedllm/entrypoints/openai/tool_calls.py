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
from collections.abc import Callable
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
        parameters, defs = hoist_defs(functions)
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                  "properties": {"name": {"enum": [fn["name"]]}, "parameters": params}}
                 for fn, params in zip(functions, parameters)]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if defs:
            schema["$defs"] = defs
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


_DEFS = ("$defs", "definitions")
_DATA = frozenset({"enum", "const", "default", "examples"})
"""Keywords whose values are JSON data, not schemas: a "$ref" key inside them is not a reference."""
_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
"""Keywords whose values map arbitrary names to schemas: a name there is not a keyword."""


def hoist_defs(functions: list[dict]) -> tuple[list[dict], dict]:
    """(each function's parameters, ready to nest in one combined schema; the ``$defs`` of that schema).

    A reference resolves from the root of the document, so "#/$defs/X" inside a tool's parameters would no
    longer resolve once they are nested: each tool's ``$defs`` / ``definitions`` move to the combined root as
    "<tool>__X" (made unique) with that tool's references rewritten, and a reference to the tool's own root
    ("#", "#/properties/...") points at a hoisted copy of it."""
    defs: dict[str, Any] = {}
    nested = []
    for fn in functions:
        params, moved = fn["parameters"], {}
        renames: dict[str, str] = {}  # "#/$defs/X" (escaped as in the refs) -> "#/$defs/<tool>__X"
        for key in _DEFS:
            block = params.get(key)
            for name, sub in (block.items() if isinstance(block, dict) else ()):
                new = _reserve(f"{fn['name']}__{name}", defs)
                renames[f"#/{key}/{_escape(name)}"] = f"#/$defs/{_escape(new)}"
                moved[new] = sub
        root: list[str] = []  # the name of the tool's hoisted root, once a reference needs one

        def rename(ref: str, renames: dict[str, str] = renames, root: list[str] = root, fn: dict = fn) -> str:
            if not ref.startswith("#"):
                return ref  # not a local reference: check_refs refuses it later, naming it
            parts = ref[2:].split("/", 2)
            head = f"#/{parts[0]}/{parts[1]}" if len(parts) >= 2 else ""
            if head in renames:
                return renames[head] + ref[len(head):]
            if not root:
                root.append(_reserve(fn["name"], defs))
            return f"#/$defs/{_escape(root[0])}{ref[1:]}"

        body = _with_refs({k: v for k, v in params.items() if k not in _DEFS}, rename)
        defs.update({name: _with_refs(sub, rename) for name, sub in moved.items()})
        if root:
            defs[root[0]] = body
            body = {"$ref": f"#/$defs/{_escape(root[0])}"}
        nested.append(body)
    return nested, defs


def _reserve(name: str, taken: dict[str, Any]) -> str:
    """``name``, or ``name_1``, ``name_2``... if taken; reserved in ``taken``."""
    unique, i = name, 0
    while unique in taken:
        i += 1
        unique = f"{name}_{i}"
    taken[unique] = None
    return unique


def _escape(name: str) -> str:
    """A name as one JSON-pointer token (RFC 6901)."""
    return name.replace("~", "~0").replace("/", "~1")


def _with_refs(schema: Any, rename: Callable[[str], str]) -> Any:
    """A copy of ``schema`` with every "$ref" renamed; iterative, since a schema nests as deep as its JSON."""
    top: dict = {}
    stack: list[tuple[Any, Any, Any, bool]] = [(top, "", schema, False)]  # (copy's parent, key, original, names)
    while stack:
        parent, key, node, names = stack.pop()
        if isinstance(node, list):
            parent[key] = items = [None] * len(node)
            stack.extend((items, i, v, False) for i, v in enumerate(node))
        elif isinstance(node, dict):
            parent[key] = copy = {}
            for k, v in node.items():
                if not names and k == "$ref" and isinstance(v, str):
                    copy[k] = rename(v)
                elif not names and k in _DATA:
                    copy[k] = v
                else:
                    copy[k] = None  # its place kept: properties are generated in their order
                    stack.append((copy, k, v, not names and k in _NAMED))
        else:
            parent[key] = node
    return top[""]


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
