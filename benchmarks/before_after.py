"""Before / after a refactor: offline throughput and serving latency of two source trees, alternating in one run.

Each tree (a checkout: e.g. `git worktree add ../pagedllm-before <commit>`) runs from its own sources with this
venv (PYTHONPATH, cwd); rounds alternate A B A B, and a short bf16 GEMM probe is logged beside each run
(this machine's speed drifts: only figures from the same run compare).

    .venv/bin/python benchmarks/before_after.py --trees ../pagedllm-before . --rounds 2

Per round and tree: `pagedllm bench throughput` (random 128/128, --num-prompts, bf16 on the dequantized
default model), then `pagedllm bench serve` at --rate against `pagedllm serve` with its engine core in a
process and, with --thread, in a thread of the API process (PAGEDLLM_ENABLE_MULTIPROCESSING=0).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from compare import engine_env, gemm_probe
from serve_sweep import stop_server, wait_healthy

PORT = 8240


def tree_env(tree: str, thread: bool = False) -> dict[str, str]:
    env = engine_env("pagedllm")
    env["PYTHONPATH"] = os.path.abspath(tree)
    if thread:
        env["PAGEDLLM_ENABLE_MULTIPROCESSING"] = "0"
    return env


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pagedllm.entrypoints.cli", *args]


def throughput(tree: str, args: argparse.Namespace, out: str) -> float:
    """Total tokens/s of one offline run."""
    subprocess.run(cli("bench", "throughput", "--dtype", "bfloat16", "--dequantize", "--input-len", "128",
                       "--output-len", "128", "--num-prompts", str(args.num_prompts), "--output-json", out),
                   cwd=tree, env=tree_env(tree), check=True, capture_output=True)
    with open(out) as f:
        return json.load(f)["tokens_per_second"]


def serving(tree: str, args: argparse.Namespace, out: str, thread: bool) -> dict:
    """`bench serve` results against a fresh `pagedllm serve` of ``tree``."""
    with open(out + ".log", "w") as log:
        proc = subprocess.Popen(cli("serve", "--host", "127.0.0.1", "--port", str(PORT), "--dtype", "bfloat16",
                                    "--dequantize", "--uvicorn-log-level", "warning"),
                                cwd=tree, env=tree_env(tree, thread), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_healthy(proc, PORT, 300.0, "pagedllm")
        subprocess.run(cli("bench", "serve", "--base-url", f"http://127.0.0.1:{PORT}", "--dataset-name",
                           "sharegpt-like", "--num-prompts", str(args.serve_prompts), "--request-rate", str(args.rate),
                           "--seed", "0", "--output-json", out), cwd=tree, env=tree_env(tree), check=True,
                       capture_output=True)
    finally:
        stop_server(proc)
    with open(out) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs=2, required=True, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=128, help="offline requests (random 128/128)")
    ap.add_argument("--serve-prompts", type=int, default=40, help="requests per serving run (sharegpt-like)")
    ap.add_argument("--rate", type=float, default=2.0, help="serving request rate (req/s)")
    ap.add_argument("--thread", action="store_true", help="also serve with the engine loop in a thread")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, tree in zip(("before", "after"), args.trees):
                probe = gemm_probe()
                row = {"round": r, "tree": name, "probe_tflops": probe,
                       "offline_tok_s": throughput(tree, args, os.path.join(tmp, "t.json"))}
                for mode in ("process", "thread") if args.thread else ("process",):
                    res = serving(tree, args, os.path.join(tmp, f"s-{mode}.json"), mode == "thread")
                    row[mode] = {"normalized_latency_s_per_token": res["normalized_latency_s_per_token"],
                                 "ttft_p50_ms": res["ttft_ms"]["p50"], "tpot_p50_ms": res["tpot_ms"]["p50"],
                                 "failed": res["failed"]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    for name in ("before", "after"):
        mine = [x for x in rows if x["tree"] == name]
        line = f"{name}: offline {statistics.mean(x['offline_tok_s'] for x in mine):.0f} tok/s"
        for mode in ("process", "thread"):
            if mode in mine[0]:
                lat = statistics.mean(x[mode]["normalized_latency_s_per_token"] for x in mine)
                ttft = statistics.mean(x[mode]["ttft_p50_ms"] for x in mine)
                tpot = statistics.mean(x[mode]["tpot_p50_ms"] for x in mine)
                line += f"; {mode}: {lat:.4f} s/token, TTFT/TPOT p50 {ttft:.0f}/{tpot:.1f} ms"
        print(line)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
