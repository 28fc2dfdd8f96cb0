"""Multi-turn chat against `pagedllm serve` at several data-parallel settings: prefix-cache hit rate and TTFT.

The workload: conversations start at Poisson times; each opens with one of a few shared system prompts and a
long first question, then sends its next question as soon as the previous answer has streamed in (the answer
goes back into the history, as a chat client does). Every setting replays the same trace against a fresh
server; the hit rate is the servers' own (Prometheus prefix_cache_hits / prefix_cache_queries, all engines).

    LD_PRELOAD=/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 .venv/bin/python benchmarks/dp_multiturn.py \\
        --settings dp1 dp2-prefix dp2-round-robin dp2-least-loaded --conversations 16 --turns 4 --rate 0.5

A setting is "dp1" (one engine, every core) or "dp2-POLICY" (two replicas, one share of the cores each);
--kv-total-mib gives every setting the same KV memory in all (each replica its share).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

WORDS = ("river stone market evening lantern copper garden window signal harbor winter orchard meadow engine "
         "pocket ladder mirror canvas thunder pepper saddle violin marble candle ribbon falcon tunnel bridge "
         "compass velvet island shadow feather crystal anchor basket blanket harvest journey kettle quarry "
         "summit timber valley whistle anthem beacon cellar dagger ember fabric glacier hollow ivory jungle").split()


@dataclass
class Conversation:
    start: float
    system: str
    questions: list[str]
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def make_trace(ns: argparse.Namespace) -> list[Conversation]:
    rng = random.Random(ns.seed)
    systems = [f"You are assistant number {i}. " + text(rng, ns.system_words) for i in range(ns.system_prompts)]
    t, convs = 0.0, []
    for i in range(ns.conversations):
        convs.append(Conversation(t, systems[i % len(systems)],
                                  [f"Question {k} of chat {i}: " + text(rng, ns.question_words)
                                   for k in range(ns.turns)]))
        t += rng.expovariate(ns.rate)
    return convs


async def run_conversation(client: httpx.AsyncClient, url: str, conv: Conversation, t0: float,
                           max_tokens: int) -> None:
    await asyncio.sleep(max(0.0, t0 + conv.start - time.monotonic()))
    messages: list[dict[str, str]] = [{"role": "system", "content": conv.system}]
    for question in conv.questions:
        messages.append({"role": "user", "content": question})
        body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}
        sent, first, answer = time.monotonic(), None, []
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                if delta:
                    first = first or time.monotonic()
                    answer.append(delta)
                    conv.tokens += 1
        conv.ttft.append((first or time.monotonic()) - sent)
        messages.append({"role": "assistant", "content": "".join(answer)})


def counters(url: str) -> dict[str, float]:
    """Prefix-cache queries and hits summed over engines."""
    total = {"prefix_cache_queries": 0.0, "prefix_cache_hits": 0.0, "generation_tokens": 0.0}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        for name in total:
            if line.startswith(f"pagedllm:{name}_total{{"):
                total[name] += float(line.rsplit(" ", 1)[1])
    return total


def serve(setting: str, port: int, ns: argparse.Namespace) -> subprocess.Popen:
    args = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *([ns.model] if ns.model else []),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "m", "--uvicorn-log-level", "warning"]
    size = 1
    if setting != "dp1":
        size, policy = setting[2:].split("-", 1)
        args += ["--data-parallel-size", size, "--data-parallel-routing", policy]
    if ns.kv_total_mib:  # the same KV memory in all, split between the replicas
        args += ["--kv-cache-memory", f"{ns.kv_total_mib // int(size)}MiB"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{setting}: the server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{setting}: the server did not start")


async def replay(url: str, trace: list[Conversation], max_tokens: int) -> float:
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.monotonic()
        await asyncio.gather(*(run_conversation(client, url, c, t0, max_tokens) for c in trace))
        return time.monotonic() - t0


def measure(setting: str, ns: argparse.Namespace, port: int) -> dict[str, Any]:
    proc = serve(setting, port, ns)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(replay(url, make_trace(argparse.Namespace(**{**vars(ns), "conversations": 2, "turns": 1,
                                                                    "seed": ns.seed + 1})), 4))  # warm-up
        before = counters(url)
        trace = make_trace(ns)
        seconds = asyncio.run(replay(url, trace, ns.max_tokens))
        after = counters(url)
    finally:
        proc.terminate()
        proc.wait(60)
    ttft = np.array([t for c in trace for t in c.ttft]) * 1000
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    return {"setting": setting, "turns": len(ttft), "seconds": seconds, "hit_rate": hits / max(1.0, queries),
            "prompt_tokens_looked_up": queries, "ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p99_ms": float(np.percentile(ttft, 99)), "ttft_mean_ms": float(ttft.mean()),
            "output_tokens_per_s": (after["generation_tokens"] - before["generation_tokens"]) / seconds}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model to serve (default: the default model, SmolLM2-135M)")
    p.add_argument("--settings", nargs="+", default=["dp1", "dp2-prefix", "dp2-round-robin", "dp2-least-loaded"])
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--rate", type=float, default=0.5, help="conversations started per second (Poisson)")
    p.add_argument("--system-prompts", type=int, default=3)
    p.add_argument("--system-words", type=int, default=200)
    p.add_argument("--question-words", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--kv-total-mib", type=int, default=None,
                   help="KV cache memory of each setting in all, split evenly between its replicas (default: each "
                        "engine's default)")
    p.add_argument("--output-json", default=None)
    ns = p.parse_args()
    results = []
    for setting in ns.settings:
        row = measure(setting, ns, ns.port)
        results.append(row)
        print(f"{setting:>18}: hit rate {row['hit_rate']:6.1%}  TTFT p50 {row['ttft_p50_ms']:8.1f} ms  p99 "
              f"{row['ttft_p99_ms']:8.1f} ms  mean {row['ttft_mean_ms']:8.1f} ms  {row['output_tokens_per_s']:6.1f} "
              f"out tok/s  {row['seconds']:.1f} s", flush=True)
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"args": vars(ns), "cpu_count": os.cpu_count(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
