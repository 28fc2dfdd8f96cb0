"""Soak: drive `pagedllm serve` for a set time with a mix of normal, streamed, cancelled, malformed and
oversized requests at ~80% of its measured capacity, then check that it held up: every request answered
or cleanly refused (a 4xx in OpenAI's error shape, or 503 + Retry-After when shedding), no 5xx and no
broken connection, 0 KV blocks held and the pool's invariants intact once drained, and the server's RSS
(its engine core process and workers included) grown by under 5% after the warm-up.

    .venv/bin/python benchmarks/soak.py --duration 1800 --output-json soak.json      # the record (30 min)
    .venv/bin/python benchmarks/soak.py --model TINY_MODEL_DIR --duration 80 --calibrate 5   # as the suite runs it
    .venv/bin/python benchmarks/soak.py --abuse --duration 600 --output-json abuse.json      # with abusive requests

Capacity is measured first (closed loop, --concurrency normal requests for --calibrate seconds); the soak
then sends Poisson arrivals at --load times it. One JSON line (and --output-json) holds the figures;
the exit status is 1 when a check fails.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.entrypoints.openai.conftest import RemoteServer  # noqa: E402

KINDS = {"normal": 0.35, "chat": 0.10, "stream": 0.25, "cancel": 0.10, "malformed": 0.10, "oversized": 0.10}
"""Share of each kind of request in the mix."""
ABUSE_SHARE = 0.15
"""With --abuse: the share of abusive requests (issue 27's list, picked at random) added to the mix."""


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


def abusive_request(rng: random.Random, max_model_len: int) -> tuple[str, str, Any, tuple[int, ...]]:
    """(name, path, JSON body or raw bytes, the statuses that answer it correctly) of one abusive request: the
    ones that crashed, froze or bloated the server before issue 27, allowed-but-heavy ones at the default limits
    (200; fresh small grammars each time, and one large one compiled once and kept: the cache's eviction is
    tested by tests/entrypoints/openai/test_abuse_structured.py), and ones over a limit (400)."""
    tag = rng.randrange(10 ** 9)  # distinct strings: nothing comes from a cache
    cases: list[tuple[str, str, Any, tuple[int, ...]]] = [
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
    ]
    return rng.choice(cases)


def rss_bytes(pid: int) -> int:
    """Resident memory of a process and every process under it (the engine core, its workers); 0 if gone."""
    try:
        server = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [server, *server.children(recursive=True)])
    except psutil.Error:
        return 0


class Soak:
    """The load generator: one request per call of ``send``, its outcome counted by kind."""

    def __init__(self, url: str, max_tokens: int, max_model_len: int, seed: int) -> None:
        self.url = url
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
        name, path, body, expected = abusive_request(self.rng, self.max_model_len)
        if isinstance(body, bytes):
            r = await client.post(f"{self.url}{path}", content=body, headers={"content-type": "application/json"})
        else:
            r = await client.post(f"{self.url}{path}", json=body)
        if r.status_code not in expected:
            self._fail(f"abuse: {name}", f"HTTP {r.status_code} (expected {expected}): {r.text[:200]}")
        elif r.status_code == 200:
            self.outcomes[(f"abuse: {name}", "ok")] += 1
        else:
            self._refused_cleanly(f"abuse: {name}", r)

    async def _oversized(self, client: httpx.AsyncClient, kind: str) -> None:
        body = self.rng.choice([
            {"prompt": "w " * (40 * self.max_model_len), "max_tokens": 4},  # over the byte cap (64 per token)
            {"prompt": "hello", "max_tokens": self.max_model_len + 1},  # could never fit
        ])
        r = await client.post(f"{self.url}/v1/completions", json=body)
        if self._refused_cleanly(kind, r) and r.status_code != 400:
            self._fail(kind, f"oversized request answered {r.status_code}")


async def calibrate(url: str, concurrency: int, seconds: float, max_tokens: int) -> float:
    """Completed normal requests per second with ``concurrency`` clients back to back."""
    done = 0
    end = time.monotonic() + seconds
    body = {"prompt": "paged attention block cache", "max_tokens": max_tokens, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        async def loop() -> None:
            nonlocal done
            while time.monotonic() < end:
                if (await client.post(f"{url}/v1/completions", json=body)).status_code == 200:
                    done += 1
        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done / seconds


async def soak(args: argparse.Namespace, url: str, pid: int, max_model_len: int, rate: float) -> dict:
    load = Soak(url, args.max_tokens, max_model_len, args.seed)
    rng = random.Random(args.seed + 1)
    mix = {**{k: w * (1 - ABUSE_SHARE) for k, w in KINDS.items()}, "abuse": ABUSE_SHARE} if args.abuse else KINDS
    kinds, weights = list(mix), list(mix.values())
    rss: list[tuple[float, int]] = []
    start = time.monotonic()
    tasks: set[asyncio.Task] = set()
    async with httpx.AsyncClient(timeout=args.timeout, limits=httpx.Limits(max_connections=256)) as client:
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
        state = httpx.get(f"{url}/kv/state", timeout=30).json()
        stats = httpx.get(f"{url}/stats", timeout=30).json()
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
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--server-log", default=os.path.join(tempfile.gettempdir(), "pagedllm-soak-server.log"),
                        help="the server's output (default: %(default)s)")
    args = parser.parse_args(argv)
    args.warmup = args.duration * 0.1 if args.warmup is None else args.warmup
    from pagedllm.models.loader import default_model_path

    server = RemoteServer(Path(args.model or default_model_path()), "--served-model-name", "soak", *args.server_arg,
                          log=Path(args.server_log))
    try:
        max_model_len = httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}, timeout=30).json()["max_model_len"]
        capacity = asyncio.run(calibrate(server.url, args.concurrency, args.calibrate, args.max_tokens))
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
