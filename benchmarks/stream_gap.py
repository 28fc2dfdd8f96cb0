"""The largest gap between the tokens of a decoding stream while a long prompt prefills (issue 43, point 5).

Starts `pagedllm serve` (the default model unless --model), opens one streamed completion, and once it decodes
sends a --prompt-len token prompt (max_tokens 1; with --prompt-logprobs K, prompt_logprobs K). Prints the
stream's largest inter-token gap before and during the long prompt, the tokens the stream got meanwhile, the
long request's latency, and the engine core's RSS (before, peak while the long prompt runs, and after it).

    .venv/bin/python benchmarks/stream_gap.py --prompt-len 8000
    .venv/bin/python benchmarks/stream_gap.py --prompt-len 8000 --prompt-logprobs 20
    .venv/bin/python benchmarks/stream_gap.py --server-args "--max-num-batched-attention 4194304"
    .venv/bin/python benchmarks/stream_gap.py --server-args "--step-time-target 0"   # the target off

PYTHONPATH picks the source tree (e.g. a `git archive` of an older commit) for before/after figures.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import threading
import time

import httpx
from serve_sweep import stop_server, wait_healthy

MODEL_STATS = ("step_time_decode_s", "step_time_token_s", "step_time_pair_s", "max_step_estimated_s")
"""The server's step-time model after the long prompt (/stats)."""


def tree_rss(pid: int) -> dict[int, int]:
    """pid -> resident bytes of ``pid`` and every descendant (from /proc)."""
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                out[p] = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, StopIteration, ProcessLookupError):
            continue
    return out


def core_pid(server_pid: int) -> int:
    """The engine core: the largest process under the server (the API process is the server itself)."""
    rss = tree_rss(server_pid)
    rss.pop(server_pid, None)
    return max(rss, key=rss.get) if rss else server_pid


class Stream(threading.Thread):
    """One streamed completion; the arrival time of each event that carries text."""

    def __init__(self, url: str, model: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.times: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        body = {"model": self.model, "prompt": "Once upon a time", "max_tokens": self.max_tokens,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if self.stop.is_set():
                    return
                if line.startswith("data: {"):
                    self.times.append(time.monotonic())


def max_gap(times: list[float], start: float, end: float) -> tuple[float, int]:
    """The largest gap between consecutive events that touches [start, end], and the events inside it."""
    gaps = [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]
    return (max(gaps) if gaps else float("nan")), sum(start <= t <= end for t in times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="served model (default: the default model)")
    p.add_argument("--port", type=int, default=8243)
    p.add_argument("--prompt-len", type=int, default=8000)
    p.add_argument("--prompt-logprobs", type=int, default=None)
    p.add_argument("--server-args", default="", help="extra `pagedllm serve` flags, one string")
    ns = p.parse_args()
    url = f"http://127.0.0.1:{ns.port}"
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *([ns.model] if ns.model else []),
           "--host", "127.0.0.1", "--port", str(ns.port), "--uvicorn-log-level", "warning",
           *shlex.split(ns.server_args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(proc, ns.port, 300.0, "pagedllm serve")
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 4}, timeout=60)
        core = core_pid(proc.pid)
        stream = Stream(url, model, max_tokens=4000)
        stream.start()
        while len(stream.times) < 20:  # decoding steadily
            time.sleep(0.05)
        rng = random.Random(0)
        prompt = [rng.randrange(100, 40000) for _ in range(ns.prompt_len)]
        body: dict = {"model": model, "prompt": prompt, "max_tokens": 1}
        if ns.prompt_logprobs is not None:
            body["prompt_logprobs"] = ns.prompt_logprobs
        rss_before = tree_rss(core).get(core, 0)
        peak = [rss_before]
        done = threading.Event()

        def sample_rss() -> None:  # the core's peak while the long prompt runs
            while not done.is_set():
                peak[0] = max(peak[0], tree_rss(core).get(core, 0))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        stats_before = httpx.get(f"{url}/stats").json()
        start = time.monotonic()
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        end = time.monotonic()
        stats_after = httpx.get(f"{url}/stats").json()
        done.set()
        sampler.join()
        time.sleep(1.0)
        rss_after = tree_rss(core).get(core, 0)
        stream.stop.set()
        base_gap, _ = max_gap([t for t in stream.times if t < start], 0, start)
        gap, tokens = max_gap(stream.times, start, end)
        mib = 1 << 20
        result = {"prompt_len": ns.prompt_len, "prompt_logprobs": ns.prompt_logprobs, "status": reply.status_code,
                  "long_request_s": round(end - start, 2), "max_gap_s": round(gap, 3),
                  "max_gap_before_s": round(base_gap, 3), "stream_tokens_meanwhile": tokens,
                  "core_rss_before_mib": rss_before // mib, "core_rss_peak_mib": peak[0] // mib,
                  "core_rss_after_mib": rss_after // mib, "server_args": ns.server_args,
                  # the long prompt's chunks (and those the step-time target shrank), the step-time model after it
                  "long_prompt_chunks": stats_after["num_chunked_prefills"] - stats_before["num_chunked_prefills"] + 1,
                  "step_time_shrunk_chunks": stats_after.get("num_step_time_shrunk_chunks", 0)
                  - stats_before.get("num_step_time_shrunk_chunks", 0),
                  **{k: float(f"{stats_after[k]:.4g}") for k in MODEL_STATS if k in stats_after},
                  "pythonpath": os.environ.get("PYTHONPATH", "")}
        print(json.dumps(result))
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main()
