"""Offline throughput and per-rank memory at tensor_parallel_size 1 and 2 (mp, ray), in one run.

Runs `pagedllm bench throughput` once per configuration per round, alternating (machines are
noisy: compare within a run), and prints a table of total tokens/s and each rank's weights, KV
pool and RSS. "tp=2 mp gloo" keeps the collectives on gloo (PAGEDLLM_CPU_SHM_ALLREDUCE=0).

    .venv/bin/python benchmarks/tensor_parallel.py --num-prompts 64 --rounds 2 [--dtype auto]
        [--configs tp=1 "tp=2 mp" "tp=2 ray" "tp=2 mp gloo"]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TP2 = ["--tensor-parallel-size", "2", "--distributed-executor-backend"]
#: name -> (flags, environment overrides)
CONFIGS = {"tp=1": ([], {}), "tp=2 mp": ([*TP2, "mp"], {}), "tp=2 ray": ([*TP2, "ray"], {}),
           "tp=2 mp gloo": ([*TP2, "mp"], {"PAGEDLLM_CPU_SHM_ALLREDUCE": "0"})}  # collectives over gloo's TCP


def run_once(flags: list[str], env: dict[str, str], ns: argparse.Namespace) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [str(Path(sys.executable).with_name("pagedllm")), "bench", "throughput", "--dataset-name", "random",
               "--random-input-len", str(ns.input_len), "--random-output-len", str(ns.output_len),
               "--num-prompts", str(ns.num_prompts), "--dtype", ns.dtype, "--output-json", out.name, *flags]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **env})
        return json.loads(Path(out.name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS)[:3], choices=list(CONFIGS))
    ns = parser.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in ns.configs}
    for r in range(ns.rounds):
        for name in ns.configs:
            results[name].append(run_once(*CONFIGS[name], ns))
            print(f"round {r + 1} {name}: {results[name][-1]['tokens_per_second']:.1f} tokens/s", flush=True)
    print("\n| config | total tokens/s (per round) | median | rank: weights / KV pool / RSS (MiB) |")
    print("|---|---|---|---|")
    for name, runs in results.items():
        speeds = [run["tokens_per_second"] for run in runs]
        ranks = "; ".join(f"{i}: {m['weights_mib']:.0f} / {m['kv_cache_mib']:.0f} / {m['rss_mib']:.0f}"
                          for i, m in enumerate(runs[-1]["ranks"]))
        print(f"| {name} | {', '.join(f'{s:.1f}' for s in speeds)} | {statistics.median(speeds):.1f} | {ranks} |")


if __name__ == "__main__":
    main()
