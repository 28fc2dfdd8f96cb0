"""``pagedllm bench serve``: load a running OpenAI-compatible server with Poisson arrivals.

Every request streams; the client records when each chunk arrives and reports throughput,
time to first token (TTFT), time per output token after the first (TPOT), inter-token
latency (ITL) and the PagedAttention paper's normalized latency (mean over requests of
end-to-end latency divided by output length).

The workloads are those of ``bench throughput`` (``--dataset-name random | sharegpt-like |
alpaca-like | sharegpt``): every request asks for exactly its output length (``max_tokens`` and
``ignore_eos``, temperature 1.0), so any OpenAI-compatible server that takes token-id prompts
(vLLM's does) runs the same requests at the same seeded Poisson arrival times. The synthetic traces
are clipped to the ``max_model_len`` the server's ``/v1/models`` card gives (at most 2048, vLLM's
ShareGPT bound), as ``bench throughput`` clips them to its engine's: every request fits.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import numpy as np

from pagedllm.entrypoints.bench import emit_json
from pagedllm.entrypoints.bench.datasets import (
    SHAREGPT_MAX_TOTAL_LEN,
    BenchRequest,
    add_dataset_args,
    check_dataset_args,
    dataset_seed,
    requests_from_args,
    summarize,
)
from pagedllm.entrypoints.cli_args import SubParsers
from pagedllm.errors import ValidationError


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def add_parser(sub: SubParsers) -> None:
    p = sub.add_parser("serve", help="load a running server with Poisson arrivals (streaming)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name sent in requests (default: the server's first)")
    p.add_argument("--tokenizer", default=None,
                   help="model whose tokenizer sizes the prompts and counts ShareGPT turns (default: SmolLM2)")
    add_dataset_args(p)
    p.add_argument("--num-prompts", type=int, default=100, help="number of requests (default: 100)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s, Poisson arrivals; inf = all at once (default: inf)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times and of the dataset (default: 0)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run)


async def _sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The stream's lines, split at "\n" only: JSON strings may hold raw U+2028 or U+0085, which
    ``aiter_lines`` (str.splitlines rules) would break a data line at (vLLM's server sends them)."""
    buffer = b""
    async for chunk in response.aiter_bytes():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.decode("utf-8").rstrip("\r")
    if buffer:
        yield buffer.decode("utf-8").rstrip("\r")


async def _one(client: httpx.AsyncClient, url: str, body: dict, prompt_len: int) -> RequestResult:
    result = RequestResult(ok=False, prompt_len=prompt_len)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in _sse_lines(response):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.ok = result.output_len > 0
    except httpx.HTTPError as e:
        result.error = repr(e)
    return result


async def _run(ns: argparse.Namespace, requests: list[BenchRequest], model: str
               ) -> tuple[list[RequestResult], float]:
    rng = np.random.default_rng(ns.seed)
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits, headers=headers) as client:
        url = f"{ns.base_url}/v1/completions"
        tasks = []
        start = time.perf_counter()
        for request in requests:
            body = {"model": model, "prompt": request.prompt, "max_tokens": request.output_len, "ignore_eos": True,
                    "temperature": 1.0, "top_p": 1.0, "stream": True, "stream_options": {"include_usage": True}}
            tasks.append(asyncio.create_task(_one(client, url, body, request.prompt_len)))
            if ns.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / ns.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    arr = np.asarray(values) * 1000
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99))}


def served_model(ns: argparse.Namespace) -> tuple[str, int | None]:
    """The model the requests name (``--model``, else the server's first) and its ``max_model_len`` from
    ``/v1/models`` (vLLM's and ours give it; None where the card does not)."""
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    cards = httpx.get(f"{ns.base_url}/v1/models", timeout=30, headers=headers).json()["data"]
    card = next((c for c in cards if c["id"] == ns.model), None) if ns.model else cards[0]
    return ns.model or card["id"], (card or {}).get("max_model_len")


def run(ns: argparse.Namespace) -> int:
    from pagedllm.engine.llm_engine import get_tokenizer

    check_dataset_args(ns)
    if not ns.request_rate > 0:
        raise ValidationError.bad_value("request_rate", ns.request_rate, "> 0 (inf = all at once)")
    tokenizer = get_tokenizer(ns.tokenizer)
    model, max_model_len = served_model(ns)
    requests = requests_from_args(ns, len(tokenizer), tokenizer, dataset_seed(ns),
                                  min(SHAREGPT_MAX_TOTAL_LEN, max_model_len or SHAREGPT_MAX_TOTAL_LEN))
    results, elapsed = asyncio.run(_run(ns, requests, model))
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    summary = {
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "request_rate": ns.request_rate if ns.request_rate != float("inf") else "inf",
        "dataset_name": ns.dataset_name, "elapsed_time": elapsed,
        "requests_per_second": len(ok) / elapsed, "output_tokens_per_second": out_tokens / elapsed,
        "tokens_per_second": (in_tokens + out_tokens) / elapsed,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats([(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "normalized_latency_s_per_token": float(np.mean([r.latency / r.output_len for r in ok])) if ok else 0.0,
    }
    mean_in, mean_out = summarize(requests)
    summary["mean_input_len"], summary["mean_output_len"] = mean_in, mean_out
    print(f"{'requests':<28}{len(ok)} ok / {len(results)} ({summary['failed']} failed), {ns.dataset_name} "
          f"(mean {mean_in:.1f} in / {mean_out:.1f} out), rate {summary['request_rate']} req/s")
    print(f"{'elapsed':<28}{elapsed:.2f} s")
    print(f"{'throughput':<28}{summary['requests_per_second']:.2f} req/s, "
          f"{summary['output_tokens_per_second']:.1f} output tok/s, {summary['tokens_per_second']:.1f} total tok/s")
    for name in ("ttft_ms", "tpot_ms", "itl_ms"):
        s = summary[name]
        print(f"{name.replace('_ms', '').upper() + ' (ms)':<28}"
              f"mean {s['mean']:.1f}  p50 {s['p50']:.1f}  p99 {s['p99']:.1f}")
    print(f"{'normalized latency':<28}{summary['normalized_latency_s_per_token']:.4f} s/token")
    for r in results:
        if not r.ok:
            print(f"failed: {r.error}")
            break
    emit_json(summary, ns.output_json)
    return 0 if ok else 1
