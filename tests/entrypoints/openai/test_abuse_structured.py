"""Structured outputs under hostile requests (a real `pagedllm serve`): every constraint is bounded in entries,
bytes and depth before it is compiled (400 naming the field), a ``$ref`` out of the schema and an unknown key of
response_format are refused, one grammar compiling to over --max-grammar-memory is refused, and the core's compiled
grammars stay within --grammar-cache-memory however many distinct grammars clients send."""
from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.utils import RemoteServer

C, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def srv(tiny_llm_dir: Path) -> Iterator[RemoteServer]:
    s = RemoteServer(tiny_llm_dir, "--served-model-name", "tiny", "--num-kv-blocks", "200", "--max-model-len", "256",
                     "--grammar-cache-memory", "64MiB", "--max-grammar-memory", "32MiB")
    yield s
    s.stop()


def _refused(r: httpx.Response, param: str) -> dict:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    return error


def _nested(depth: int) -> dict:
    """A schema whose JSON nests 2 * depth + 1 levels (an object property per level)."""
    schema: dict = {"type": "string"}
    for i in range(depth):
        schema = {"type": "object", "properties": {f"k{i}": schema}, "required": [f"k{i}"]}
    return schema


def _schema_format(schema: Any, **extra: Any) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, **extra}}


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"choice": [f"c{i}" for i in range(1025)]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["x" * 1000] * 70}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a" * 70_000}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": 'root ::= "' + "a" * 70_000 + '"'}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": json.dumps(_nested(40))}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": "[" * 100_000 + "]" * 100_000}}, "structured_outputs.json"),
    ({"response_format": _schema_format({"enum": ["v" * 100] * 700})}, "response_format.json_schema.schema"),
    ({"response_format": _schema_format(_nested(32))}, "response_format.json_schema.schema"),
    ({"response_format": _schema_format({"$ref": "https://example.com/s.json"})}, "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": {"properties": {"a": {"$ref": "/etc/passwd"}}}}}, "structured_outputs.json"),
    ({"response_format": {"type": "json_object", "schema": {"type": "object"}}}, "response_format.schema"),
    ({"response_format": _schema_format({"type": "object"}, strictness=True)},
     "response_format.json_schema.strictness"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
    ({"structured_outputs": {"json_object": True, "whitespace_pattern": " "}}, "structured_outputs"),
])
def test_each_constraint_over_a_limit_or_unenforceable_is_a_400(srv: RemoteServer, body: dict, param: str) -> None:
    _refused(httpx.post(f"{srv.url}{C}", json={"prompt": "hi", "max_tokens": 2, **body}, timeout=30), param)


def test_at_the_limits_constraints_are_served(srv: RemoteServer) -> None:
    local = {"$defs": {"c": {"enum": ["Paris", "Rome"]}}, "type": "object", "additionalProperties": False,
             "required": ["city"], "properties": {"city": {"$ref": "#/$defs/c"}}}
    for body in ({"structured_outputs": {"choice": [f"c{i}" for i in range(1024)]}},
                 {"response_format": _schema_format(_nested(31), strict=True, description="d")},
                 {"response_format": _schema_format(local)}):
        r = httpx.post(f"{srv.url}{C}", json={"prompt": "hi", "max_tokens": 2, **body}, timeout=60)
        assert r.status_code == 200, r.text


def test_a_deep_tool_schema_is_a_400_naming_tools(srv: RemoteServer) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": _nested(40)}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "required"}
    _refused(httpx.post(f"{srv.url}{CHAT}", json=body, timeout=30), "tools")


def _core(srv: RemoteServer) -> psutil.Process:
    (core,) = [p for p in psutil.Process(srv.proc.pid).children()
               if "pagedllm.engine.core_proc" in " ".join(p.cmdline())]
    return core


def _big_grammar(k: int, alternatives: int = 900) -> str:
    """A distinct grammar of ~15 KB that xgrammar compiles into ~7 MB (measured as ~27 MB: under
    --max-grammar-memory); 2,500 alternatives make one of ~74 MB."""
    return "root ::= " + " ".join(f'"{k}-{i:04d}" [a-z]*' for i in range(alternatives))


def _wide_schema(k: int, properties: int = 1400) -> dict:
    """A distinct ~55 KB JSON schema of ``properties`` required scalar properties (~9 MB compiled, measured as
    ~28 MB: under --max-grammar-memory); xgrammar's own cache kept ~8 MB of each past its limit."""
    types = ("string", "integer", "number", "boolean")
    names = [f"{k:02x}{i:03x}" for i in range(properties)]
    return {"type": "object", "properties": {n: {"type": types[i % 4]} for i, n in enumerate(names)},
            "required": names}


def _grammar_bound_test(srv: RemoteServer, bodies: Iterator[dict], bound: int) -> None:
    core = _core(srv)
    body = {"prompt": "hi", "max_tokens": 1, "structured_outputs": {"regex": "[a-z]+"}}
    assert httpx.post(f"{srv.url}{C}", json=body, timeout=60).status_code == 200  # the compiler exists
    before = core.memory_info().rss
    peak = before
    for body in bodies:
        r = httpx.post(f"{srv.url}{C}", json={"prompt": "hi", "max_tokens": 1, **body}, timeout=120)
        assert r.status_code == 200, r.text
        peak = max(peak, core.memory_info().rss)
    assert peak - before < bound + 300 * 2 ** 20, f"core RSS grew {(peak - before) / 2 ** 20:.0f} MiB"
    assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200


def test_many_distinct_large_grammars_stay_within_the_cache_bound(srv: RemoteServer) -> None:
    # 20 such grammars kept would be ~140 MB
    _grammar_bound_test(srv, ({"structured_outputs": {"grammar": _big_grammar(k)}} for k in range(20)), 64 * 2 ** 20)


def test_many_distinct_large_schemas_stay_within_the_cache_bound(srv: RemoteServer) -> None:
    """xgrammar's estimate leaves out a share of what a grammar holds and its own cache kept more past its limit:
    the core grew ~5 MB per such schema at a 64 MiB --grammar-cache-memory, without end (+364 MiB after 70)."""
    assert 50_000 < len(json.dumps(_wide_schema(0))) < 64 * 1024
    bodies = ({"response_format": _schema_format(_wide_schema(k))} for k in range(120))
    _grammar_bound_test(srv, bodies, 64 * 2 ** 20)


def test_a_grammar_over_the_per_request_budget_is_a_400_and_others_are_served(srv: RemoteServer) -> None:
    plain = {"prompt": "hi", "max_tokens": 4, "stream": True}
    heavy = {"prompt": "hi", "max_tokens": 1, "structured_outputs": {"grammar": _big_grammar(99, 2500)}}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        refused = pool.submit(httpx.post, f"{srv.url}{C}", json=heavy, timeout=120)
        served = pool.submit(httpx.post, f"{srv.url}{C}", json=plain, timeout=120)
        error = _refused(refused.result(), "structured_outputs.grammar")
        assert "--max-grammar-memory" in error["message"], error
        assert served.result().status_code == 200 and "[DONE]" in served.result().text
    body = {"prompt": "hi", "max_tokens": 1, "structured_outputs": {"grammar": _big_grammar(98)}}
    assert httpx.post(f"{srv.url}{C}", json=body, timeout=120).status_code == 200  # under the budget: served
