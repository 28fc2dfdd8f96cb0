"""Concurrency: 64 streams batched together; 16 dropped streams free everything at once."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai


async def _stream_one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int, str | None]:
    stream = await client.completions.create(model="tiny", prompt=f"Client number {i} says", max_tokens=48,
                                             temperature=0, stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    text, tokens, reason = "", 0, None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return text, tokens, reason


async def _watch_running(server, stop: asyncio.Event) -> int:
    """Highest pagedllm:num_requests_running seen while the clients run."""
    highest = 0
    async with httpx.AsyncClient() as http:
        while not stop.is_set():
            for line in (await http.get(f"{server.url}/metrics")).text.splitlines():
                if line.startswith("pagedllm:num_requests_running{"):
                    highest = max(highest, int(float(line.rsplit(" ", 1)[1])))
            await asyncio.sleep(0.02)
    return highest


def test_64_concurrent_streams_share_steps(server) -> None:
    async def main() -> tuple[list, int]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                    http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=100)))
        stop = asyncio.Event()
        watcher = asyncio.create_task(_watch_running(server, stop))
        results = await asyncio.wait_for(asyncio.gather(*(_stream_one(client, i) for i in range(64))), 240)
        stop.set()
        return results, await watcher

    results, highest_running = asyncio.run(main())
    assert len(results) == 64
    for text, tokens, reason in results:
        assert tokens == 48 and reason == "length" and text
    reference = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x").completions.create(
        model="tiny", prompt="Client number 5 says", max_tokens=48, temperature=0,
        extra_body={"ignore_eos": True}).choices[0].text
    assert results[5][0] == reference  # batched with 63 others, the same greedy text as alone
    stats = httpx.get(f"{server.url}/stats").json()
    assert highest_running >= 32 and stats["max_num_running"] >= 32, (highest_running, stats)


def test_dropped_streams_free_everything(server) -> None:
    responses = []
    with httpx.Client(timeout=30) as http:
        for i in range(16):
            req = http.build_request("POST", f"{server.url}/v1/completions", json={
                "model": "tiny", "prompt": f"Drop me {i}", "max_tokens": 400, "stream": True, "ignore_eos": True})
            responses.append(http.send(req, stream=True))
        for r in responses:  # read a little of each stream, then hang up
            assert r.status_code == 200
            lines = r.iter_lines()
            while not next(lines).startswith("data:"):
                pass
        assert server.metric("pagedllm:num_requests_running") > 0
        for r in responses:
            r.close()
        dropped_at = time.monotonic()
        while time.monotonic() - dropped_at < 2.0:
            if (server.metric("pagedllm:num_requests_running") == 0
                    and server.metric("pagedllm:kv_cache_usage_perc") == 0):
                break
            time.sleep(0.05)
        assert server.metric("pagedllm:num_requests_running") == 0
        assert server.metric("pagedllm:kv_cache_usage_perc") == 0.0
        assert server.metric("pagedllm:num_requests_waiting") == 0
        ok = http.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "still up", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
