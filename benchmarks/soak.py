"""Soak: drive `pagedllm serve` for a set time with a mix of normal, streamed, cancelled, malformed and
oversized requests at ~80% of its measured capacity, then check that it held up: every request answered
or cleanly refused (a 4xx in OpenAI's error shape, or 503 + Retry-After when shedding), no 5xx and no
broken connection, 0 KV blocks held and the pool's invariants intact once drained, and the server's RSS
(its engine core process and workers included) grown by under 5% after the warm-up.

    .venv/bin/python benchmarks/soak.py --duration 1800 --output-json soak.json      # the record (30 min)
    .venv/bin/python benchmarks/soak.py --model TINY_MODEL_DIR --duration 80 --calibrate 5   # as the suite runs it
    .venv/bin/python benchmarks/soak.py --abuse --duration 600 --output-json abuse.json      # with abusive requests
    .venv/bin/python benchmarks/soak.py --abuse --api-key A --api-key B --duration 600  # and cross-key access

Capacity is measured first (closed loop, --concurrency normal requests for --calibrate seconds); the soak
then sends Poisson arrivals at --load times it. One JSON line (and --output-json) holds the figures;
the exit status is 1 when a check fails.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.entrypoints.openai.conftest import RemoteServer  # noqa: E402

KINDS = {"normal": 0.35, "chat": 0.10, "stream": 0.25, "cancel": 0.10, "malformed": 0.10, "oversized": 0.10}
"""Share of each kind of request in the mix."""
ABUSE_SHARE = 0.15
"""With --abuse: the share of abusive requests (issues 27's and 43's lists, picked at random) added to the mix."""
REFUSAL_TIMEOUT = 30.0
"""Client timeout of an abusive request that must be refused at once (a server that takes it instead would hold
the soak for as long as it runs; leaving aborts it)."""
CROSS_KEY = "cross-key stored response"
"""The abusive case that needs two --api-key: a response stored with the first key, read and deleted with the
second (404 each time, as for an id never stored)."""


class Abuse(NamedTuple):
    """One abusive request and the answers that are correct for it."""

    name: str
    path: str
    body: Any
    """A JSON body, or raw bytes."""
    expected: tuple[int, ...]
    check: Callable[[dict], str | None] | None = None
    """For a 200: what is wrong with the answer's JSON (None: nothing)."""


def _tools(count: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"tool_{i}", "description": "does a thing " * 10,
                                              "parameters": {"type": "object", "properties": {
                                                  "a": {"type": "string"}, "b": {"type": "integer"}}}}}
            for i in range(count)]


def _deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for i in range(depth):
        schema = {"type": "object", "properties": {f"k{i}": schema}, "required": [f"k{i}"]}
    return schema


def _tiny_values_body() -> bytes:
    """Issue 43: a legal (just under --max-body-bytes' 16 MiB) chat body of millions of tiny values in tool_calls."""
    head = b'{"max_tokens": 4, "messages": [{"role": "assistant", "content": "", "tool_calls": ['
    tail = b'[]]}, {"role": "user", "content": "hi"}]}'
    return head + b"[]," * ((16 * 2**20 - 64 - len(head) - len(tail)) // 3) + tail


TINY_VALUES_BODY = functools.lru_cache(maxsize=1)(_tiny_values_body)
"""The 16 MiB body, built once (sent as it is each time)."""


def _wide_schema(tag: int, properties: int = 1400) -> dict:
    """Issue 43: a distinct ~55 KB JSON schema of ``properties`` string properties."""
    return {"type": "object", "properties": {f"p{tag}_{i:04d}": {"type": "string"} for i in range(properties)}}


NESTED_TOOL = {"type": "function", "function": {"name": "plan_trip", "strict": True, "parameters": {
    "$defs": {"Stop": {"type": "object", "additionalProperties": False, "required": ["city", "nights"],
                       "properties": {"city": {"enum": ["Paris", "Oslo"]}, "nights": {"enum": [1, 2, 3]}}}},
    "type": "object", "additionalProperties": False, "required": ["start", "stops"],
    "properties": {"start": {"$ref": "#/$defs/Stop"}, "stops": {"type": "array", "maxItems": 2,
                                                               "items": {"$ref": "#/$defs/Stop"}}}}}}
"""A tool as Pydantic writes a nested model (openai.pydantic_function_tool): refs into $defs."""

SDK_ASSISTANT = {"role": "assistant", "content": "Hello!", "refusal": None, "annotations": None, "audio": None,
                 "function_call": None, "tool_calls": None, "reasoning_content": None}
"""A reply's message as the openai SDK's model_dump() appends it to the history."""


def _finite_logprobs(answer: dict) -> str | None:
    """Issue 43: logprobs with structured outputs are finite numbers (never -inf, NaN or null)."""
    values: list[Any] = []
    for choice in answer["choices"]:
        lp = choice.get("logprobs") or {}
        if "token_logprobs" in lp:  # completions
            values += lp["token_logprobs"] + [v for top in lp["top_logprobs"] for v in (top or {}).values()]
        for token in lp.get("content") or []:  # chat
            values += [token["logprob"], *(t["logprob"] for t in token["top_logprobs"])]
    if not values:
        return "no logprobs"
    bad = [v for v in values if not (isinstance(v, (int, float)) and math.isfinite(v))]
    return f"non-finite logprobs {bad[:3]}" if bad else None


def _tool_called(answer: dict) -> str | None:
    """A forced tool call: arguments that parse as JSON (or a reply cut by max_tokens)."""
    choice = answer["choices"][0]
    if choice["finish_reason"] == "length":
        return None
    calls = choice["message"]["tool_calls"] or []
    if choice["finish_reason"] != "tool_calls" or not calls:
        return f"no tool call: {choice}"
    try:
        for call in calls:
            json.loads(call["function"]["arguments"])
    except ValueError:
        return f"arguments are not JSON: {calls}"
    return None


def abusive_request(rng: random.Random, max_model_len: int, cross_key: bool = False) -> Abuse:
    """One abusive request: the ones that crashed, froze or bloated the server before issue 27, allowed-but-heavy
    ones at the default limits (200; fresh small grammars each time, and one large one compiled once and kept: the
    cache's eviction is tested by tests/entrypoints/openai/test_abuse_structured.py), ones over a limit (400), and
    issue 43's (``cross_key``: the soak has two API keys, and the stored-response case is among them)."""
    tag = rng.randrange(10 ** 9)  # distinct strings: nothing comes from a cache
    long_prompt = [rng.randrange(100, 1000) for _ in range(min(8000, max_model_len - 8))]  # ids any vocabulary has
    cases: list[tuple] = [
        ("seed 2**64-1 n=2", "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "seed": 2 ** 64 - 1, "n": 2},
         (400,)),
        ("length_penalty -1e308", "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "n": 2,
                                                      "use_beam_search": True, "length_penalty": -1e308}, (400,)),
        ("length_penalty -Infinity", "/v1/completions",
         b'{"prompt": "Hello", "max_tokens": 4, "n": 2, "use_beam_search": true, "length_penalty": -Infinity}', (400,)),
        ("n 10**9", "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "n": 10 ** 9}, (400,)),
        ("20k bad_words", "/v1/completions", {"prompt": "hi", "max_tokens": 4,
                                              "bad_words": [f"w{i}" for i in range(20_000)]}, (400,)),
        ("100k stops", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "stop": [f"s{i}" for i in range(100_000)]},
         (400,)),
        ("3000 tools", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                "tool_choice": "required", "tools": _tools(3000)}, (400,)),
        ("100k choices", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "structured_outputs": {
            "choice": [f"c{i}" for i in range(100_000)]}}, (400,)),
        ("300-deep schema", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "response_format": {
            "type": "json_schema", "json_schema": {"name": "d", "schema": _deep_schema(300)}}}, (400,)),
        ("$ref to a URL", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "response_format": {
            "type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "http://example.invalid/s"}}}},
         (400,)),
        ("unknown response_format key", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "response_format": {
            "type": "json_object", "strictness": "very"}}, (400,)),
        ("lone surrogate", "/v1/completions", b'{"prompt": "Hel\\ud800lo", "max_tokens": 2}', (400,)),
        ("tool_choice function as a string", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "tools": _tools(1),
            "tool_choice": {"type": "function", "function": "f"}}, (400,)),
        ("10 MB /tokenize", "/tokenize", {"prompt": "w " * (5 * 2 ** 20)}, (400,)),
        ("100k tokens /detokenize", "/detokenize", {"tokens": [1] * 100_000}, (400,)),
        ("100k-deep JSON string schema", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "structured_outputs": {
            "json": "[" * 100_000 + "]" * 100_000}}, (400,)),
        ("$ref to a file", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "structured_outputs": {
            "json": {"properties": {"a": {"$ref": "file:///etc/passwd"}}}}}, (400,)),
        ("100 KB grammar", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "structured_outputs": {
            "grammar": 'root ::= "' + "a" * 100_000 + '"'}}, (400,)),
        ("run-time LoRA load (off)", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}, (404,)),
        ("256 bad_words", "/v1/completions", {"prompt": "hi", "max_tokens": 4,
                                              "bad_words": [f"word{tag}-{i}" for i in range(256)]}, (200, 503)),
        ("64 stops", "/v1/completions", {"prompt": "hi", "max_tokens": 4,
                                         "stop": [f"stop{tag}-{i}" for i in range(64)]}, (200, 503)),
        ("128 tools required", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "tool_choice": "required",
            "tools": [{**t, "function": {**t["function"], "name": f"{t['function']['name']}_{tag}"}}
                      for t in _tools(128)]}, (200, 503)),
        ("1024 choices", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "structured_outputs": {
            "choice": [f"option {tag} number {i}" for i in range(1024)]}}, (200, 503)),
        ("48 KB grammar", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "structured_outputs": {  # ~20 MB
            "grammar": "root ::= " + " ".join(f'"{i:05d}" [a-z]*' for i in range(3000))}}, (200, 503)),  # compiled
        ("30-deep schema", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "response_format": {
            "type": "json_schema", "json_schema": {"name": "d", "schema": _deep_schema(30) | {"title": str(tag)}}}},
         (200, 503)),
        # issue 43
        ("16 MiB of tiny values", "/v1/chat/completions", TINY_VALUES_BODY(), (400, 413)),
        ("over-product n*max_tokens*logprobs", "/v1/completions", {
            "prompt": ["a", "b", "c", "d"], "n": 256, "max_tokens": 8000, "ignore_eos": True, "logprobs": 20}, (400,)),
        ("55 KB distinct schema", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "response_format": {
            "type": "json_schema", "json_schema": {"name": "w", "schema": _wide_schema(tag)}}}, (200, 400, 503)),
        ("logprobs + choice", "/v1/completions", {"prompt": "Pick:", "max_tokens": 3, "logprobs": 5,
                                                  "structured_outputs": {"choice": ["yes", "no"]}}, (200, 503),
         _finite_logprobs),
        ("chat logprobs + choice", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Pick:"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 5,
            "structured_outputs": {"choice": ["yes", "no"]}}, (200, 503), _finite_logprobs),
        ("SDK multi-turn message", "/v1/chat/completions", {"max_tokens": 4, "messages": [
            {"role": "user", "content": "hi"}, SDK_ASSISTANT, {"role": "user", "content": f"again {tag}"}]},
         (200, 503)),
        ("required tool with $defs", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Plan a trip."}], "max_tokens": 64, "tool_choice": "required",
            "tools": [NESTED_TOOL]}, (200, 503), _tool_called),
        ('"stream": "yes"', "/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": "yes"}, (400,)),
        ("8k-token prompt", "/v1/completions", {"prompt": long_prompt, "max_tokens": 4}, (200, 503)),
    ]
    if cross_key:
        cases.append((CROSS_KEY, "/v1/responses", {"input": f"hi {tag}", "max_output_tokens": 4, "store": True},
                      (404,)))
    return Abuse(*rng.choice(cases))


def rss_bytes(pid: int) -> int:
    """Resident memory of a process and every process under it (the engine core, its workers); 0 if gone."""
    try:
        server = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [server, *server.children(recursive=True)])
    except psutil.Error:
        return 0


class Soak:
    """The load generator: one request per call of ``send``, its outcome counted by kind."""

    def __init__(self, url: str, max_tokens: int, max_model_len: int, seed: int, keys: tuple[str, ...] = ()
                 ) -> None:
        self.url = url
        self.keys = keys
        """The server's API keys: requests carry the first (the client's own header); the cross-key case the second."""
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        self.rng = random.Random(seed)
        self.outcomes: Counter = Counter()
        self.failures: list[str] = []
        self.failed = 0
        self.latencies: list[float] = []

    def _fail(self, kind: str, what: str, count: bool = True) -> None:
        """A request that was not answered as it should be (``count``: it has no outcome of its own yet)."""
        if count:
            self.outcomes[(kind, "FAILED")] += 1
        self.failed += 1
        if len(self.failures) < 20:
            self.failures.append(f"{kind}: {what}")

    def _refused_cleanly(self, kind: str, r: httpx.Response) -> bool:
        """A 4xx in OpenAI's error shape, or 503 with Retry-After (load shedding)."""
        try:
            error = r.json()["error"]
            shaped = isinstance(error["message"], str) and isinstance(error["type"], str)
        except (ValueError, KeyError, TypeError):
            shaped = False
        clean = shaped and (400 <= r.status_code < 500 or (r.status_code == 503 and "retry-after" in r.headers))
        self.outcomes[(kind, f"refused {r.status_code}" if clean else f"BAD {r.status_code}")] += 1
        if not clean:
            self._fail(kind, f"HTTP {r.status_code}: {r.text[:200]}", count=False)
        return clean

    def _body(self, stream: bool = False) -> dict:
        words = " ".join(self.rng.choice(("paged", "attention", "block", "cache", "token", "step"))
                         for _ in range(self.rng.randint(3, 40)))
        return {"prompt": words, "max_tokens": self.rng.randint(4, self.max_tokens), "temperature": 1.0,
                "stream": stream}

    async def send(self, client: httpx.AsyncClient, kind: str) -> None:
        start = time.monotonic()
        try:
            await getattr(self, f"_{kind}")(client, kind)
        except httpx.HTTPError as e:  # a connection the server dropped or never answered
            self._fail(kind, f"{type(e).__name__}: {e}")
        else:
            if kind == "normal":
                self.latencies.append(time.monotonic() - start)

    async def _normal(self, client: httpx.AsyncClient, kind: str) -> None:
        r = await client.post(f"{self.url}/v1/completions", json=self._body())
        if r.status_code == 200:
            ok = r.json()["choices"][0]["finish_reason"] in ("stop", "length")
            self.outcomes[(kind, "ok" if ok else "BAD finish")] += 1
            if not ok:
                self._fail(kind, r.text[:200], count=False)
        else:
            self._refused_cleanly(kind, r)

    async def _chat(self, client: httpx.AsyncClient, kind: str) -> None:
        body = self._body()
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
        r = await client.post(f"{self.url}/v1/chat/completions", json=body)
        if r.status_code == 200:
            self.outcomes[(kind, "ok")] += 1
        else:
            self._refused_cleanly(kind, r)

    async def _stream(self, client: httpx.AsyncClient, kind: str, cancel_after: int | None = None) -> None:
        async with client.stream("POST", f"{self.url}/v1/completions", json=self._body(stream=True)) as r:
            if r.status_code != 200:
                await r.aread()
                self._refused_cleanly(kind, r)
                return
            events = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if cancel_after is not None and len(events) >= cancel_after:
                        self.outcomes[(kind, "cancelled")] += 1
                        return  # leaving the block closes the connection: the server must abort the request
        if events and events[-1] == "[DONE]" and not any(e.startswith('{"error"') for e in events):
            self.outcomes[(kind, "ok")] += 1
        elif cancel_after is not None:
            self.outcomes[(kind, "finished before the cancel")] += 1
        else:
            self._fail(kind, f"stream ended with {events[-2:]}")

    async def _cancel(self, client: httpx.AsyncClient, kind: str) -> None:
        await self._stream(client, kind, cancel_after=self.rng.randint(1, 4))

    async def _malformed(self, client: httpx.AsyncClient, kind: str) -> None:
        bad = self.rng.choice([
            b'{"prompt": "unterminated', b'[]', b'{"prompt": 5, "max_tokens": "many"}',
            json.dumps({"prompt": "x", "temperature": -3}).encode(), json.dumps({"prompt": "x", "n": 0}).encode(),
            json.dumps({"prompt": "x", "no_such_field": 1}).encode(), json.dumps({"prompt": []}).encode(),
        ])
        r = await client.post(f"{self.url}/v1/completions", content=bad, headers={"content-type": "application/json"})
        if self._refused_cleanly(kind, r) and r.status_code != 400:
            self._fail(kind, f"malformed body answered {r.status_code}")

    async def _abuse(self, client: httpx.AsyncClient, kind: str) -> None:
        case = abusive_request(self.rng, self.max_model_len, cross_key=len(self.keys) >= 2)
        name = f"abuse: {case.name}"
        if case.name == CROSS_KEY:
            await self._cross_key(client, name, case)
            return
        sent: dict[str, Any] = ({"content": case.body, "headers": {"content-type": "application/json"}}
                                if isinstance(case.body, bytes) else {"json": case.body})
        if all(400 <= status < 500 for status in case.expected):  # to be refused at once
            sent["timeout"] = REFUSAL_TIMEOUT
        try:
            r = await client.post(f"{self.url}{case.path}", **sent)
        except httpx.TimeoutException:
            self._fail(name, f"not refused within {REFUSAL_TIMEOUT:g} s (expected {case.expected})")
            return
        if r.status_code not in case.expected:
            self._fail(name, f"HTTP {r.status_code} (expected {case.expected}): {r.text[:200]}")
        elif r.status_code == 200:
            problem = case.check(r.json()) if case.check is not None else None
            if problem is None:
                self.outcomes[(name, "ok")] += 1
            else:
                self._fail(name, problem[:300])
        else:
            self._refused_cleanly(name, r)

    async def _cross_key(self, client: httpx.AsyncClient, name: str, case: Abuse) -> None:
        """A response stored with the first key: 404 to the second key's GET and DELETE, still there for the
        first's GET, then deleted by it."""
        r = await client.post(f"{self.url}{case.path}", json=case.body)
        if r.status_code != 200:
            if self._refused_cleanly(name, r) and r.status_code != 503:
                self._fail(name, f"storing a response answered {r.status_code}")
            return
        url, other = f"{self.url}/v1/responses/{r.json()['id']}", {"authorization": f"Bearer {self.keys[1]}"}
        answers = [(await client.get(url, headers=other)).status_code,
                   (await client.delete(url, headers=other)).status_code,
                   (await client.get(url)).status_code, (await client.delete(url)).status_code]
        if answers == [404, 404, 200, 200]:
            self.outcomes[(name, "refused 404")] += 1
        else:
            self._fail(name, f"other key's GET, DELETE, own GET, DELETE answered {answers} (expected 404, 404, 200, "
                             "200)")

    async def _oversized(self, client: httpx.AsyncClient, kind: str) -> None:
        body = self.rng.choice([
            {"prompt": "w " * (40 * self.max_model_len), "max_tokens": 4},  # over the byte cap (64 per token)
            {"prompt": "hello", "max_tokens": self.max_model_len + 1},  # could never fit
        ])
        r = await client.post(f"{self.url}/v1/completions", json=body)
        if self._refused_cleanly(kind, r) and r.status_code != 400:
            self._fail(kind, f"oversized request answered {r.status_code}")


def auth(keys: tuple[str, ...]) -> dict[str, str]:
    """The headers of the soak's requests: the first API key, if the server has any."""
    return {"authorization": f"Bearer {keys[0]}"} if keys else {}


async def calibrate(url: str, concurrency: int, seconds: float, max_tokens: int, keys: tuple[str, ...] = ()
                    ) -> float:
    """Completed normal requests per second with ``concurrency`` clients back to back."""
    done = 0
    end = time.monotonic() + seconds
    body = {"prompt": "paged attention block cache", "max_tokens": max_tokens, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency + 4),
                                 headers=auth(keys)) as client:
        async def loop() -> None:
            nonlocal done
            while time.monotonic() < end:
                if (await client.post(f"{url}/v1/completions", json=body)).status_code == 200:
                    done += 1
        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done / seconds


async def soak(args: argparse.Namespace, url: str, pid: int, max_model_len: int, rate: float) -> dict:
    keys = tuple(args.api_key)
    load = Soak(url, args.max_tokens, max_model_len, args.seed, keys)
    rng = random.Random(args.seed + 1)
    mix = {**{k: w * (1 - ABUSE_SHARE) for k, w in KINDS.items()}, "abuse": ABUSE_SHARE} if args.abuse else KINDS
    kinds, weights = list(mix), list(mix.values())
    rss: list[tuple[float, int]] = []
    start = time.monotonic()
    tasks: set[asyncio.Task] = set()
    async with httpx.AsyncClient(timeout=args.timeout, limits=httpx.Limits(max_connections=256),
                                 headers=auth(keys)) as client:
        next_rss = start
        while (now := time.monotonic()) < start + args.duration:
            if now >= next_rss:
                rss.append((now - start, rss_bytes(pid)))
                next_rss += 5.0
            task = asyncio.create_task(load.send(client, rng.choices(kinds, weights)[0]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(rng.expovariate(rate))
        if tasks:
            _, unfinished = await asyncio.wait(tasks, timeout=args.timeout)
            for task in unfinished:  # never answered within the client timeout
                task.cancel()
                load._fail("unknown", f"no answer within {args.timeout:g} s")
    sent = sum(load.outcomes.values())
    # drained: nothing running, every block back, the invariants intact
    deadline = time.monotonic() + 30
    while True:
        state = httpx.get(f"{url}/kv/state", timeout=30, headers=auth(keys)).json()
        stats = httpx.get(f"{url}/stats", timeout=30, headers=auth(keys)).json()
        if (state["accounting"]["used_blocks"] == 0 and stats["num_running"] == stats["num_waiting"] == 0) \
                or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    rss.append((time.monotonic() - start, rss_bytes(pid)))
    after_warmup = [b for t, b in rss if t >= args.warmup] or [rss[-1][1]]
    growth = (rss[-1][1] - after_warmup[0]) / after_warmup[0]
    latencies = sorted(load.latencies) or [0.0]
    fivexx = sum(n for (_, outcome), n in load.outcomes.items()
                 if outcome.split()[-1].isdigit() and int(outcome.split()[-1]) >= 500)
    checks = {
        "every request answered or cleanly refused": load.failed == 0,
        "0 KV blocks held after draining": state["accounting"]["used_blocks"] == 0,
        "check_integrity": state["integrity"] == "ok",
        "nothing running or waiting": stats["num_running"] == stats["num_waiting"] == 0,
        "RSS growth under 5% after the warm-up": growth < 0.05,
        "server alive": httpx.get(f"{url}/health", timeout=10).status_code == 200,
    }
    if args.abuse:  # no load shedding is configured by default: every 5xx would be the server's failure
        checks["0 5xx answers"] = fivexx == 0
    return {"duration_s": args.duration, "rate_per_s": rate, "requests": sent,
            "outcomes": {f"{k} {o}": n for (k, o), n in sorted(load.outcomes.items())},
            "failures": load.failures, "responses_5xx": fivexx, "normal_latency_p50_s": latencies[len(latencies) // 2],
            "normal_latency_p99_s": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
            "rss_mib_after_warmup": after_warmup[0] / 2**20, "rss_mib_end": rss[-1][1] / 2**20,
            "rss_growth": growth, "kv_integrity": state["integrity"], "checks": checks, "passed": all(checks.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="the model to serve (default: the default model)")
    parser.add_argument("--server-arg", action="append", default=[], help="extra `pagedllm serve` flag (repeatable; "
                        "a flag and its value as one argument, e.g. '--max-num-seqs=64')")
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of soak (default: 30 minutes)")
    parser.add_argument("--warmup", type=float, default=None, help="seconds before the RSS baseline (default: 10%%)")
    parser.add_argument("--load", type=float, default=0.8, help="share of the measured capacity to send")
    parser.add_argument("--calibrate", type=float, default=15.0, help="seconds of the capacity measurement")
    parser.add_argument("--concurrency", type=int, default=32, help="clients of the capacity measurement")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens a normal request asks for")
    parser.add_argument("--timeout", type=float, default=300.0, help="client timeout per request, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--abuse", action="store_true",
                        help=f"add {ABUSE_SHARE * 100:.0f}%% abusive requests to the mix "
                        "(crashers, oversized lists, heavy grammars, bad Unicode: each must be answered or refused "
                        "with a 4xx, never a 5xx)")
    parser.add_argument("--api-key", action="append", default=[],
                        help="start the server with this API key (repeatable); with two, --abuse also checks that "
                        "one key cannot read or delete the other's stored responses")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--server-log", default=os.path.join(tempfile.gettempdir(), "pagedllm-soak-server.log"),
                        help="the server's output (default: %(default)s)")
    args = parser.parse_args(argv)
    args.warmup = args.duration * 0.1 if args.warmup is None else args.warmup
    from pagedllm.models.loader import default_model_path

    keys = tuple(args.api_key)
    server = RemoteServer(Path(args.model or default_model_path()), "--served-model-name", "soak", *args.server_arg,
                          *(arg for key in keys for arg in ("--api-key", key)), log=Path(args.server_log))
    try:
        max_model_len = httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}, timeout=30,
                                   headers=auth(keys)).json()["max_model_len"]
        capacity = asyncio.run(calibrate(server.url, args.concurrency, args.calibrate, args.max_tokens, keys))
        if capacity <= 0:
            raise SystemExit(f"no request completed in the {args.calibrate:g} s capacity measurement")
        result = asyncio.run(soak(args, server.url, server.proc.pid, max_model_len, capacity * args.load))
        result["capacity_per_s"] = capacity
        alive = server.proc.poll() is None
    finally:
        server.stop()
    result["checks"]["server alive"] = result["checks"]["server alive"] and alive
    result["passed"] = all(result["checks"].values())
    line = json.dumps(result)
    print(line)
    if args.output_json:
        Path(args.output_json).write_text(line + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
