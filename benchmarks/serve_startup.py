"""`pagedllm serve` start-up of two source trees, alternating in one run: seconds from the process's start to
/health answering 200, to a first completion's reply, and from SIGTERM to the process's exit.

Each tree (a checkout: e.g. `git worktree add ../pagedllm-before <commit>`) runs from its own sources with this
venv (PYTHONPATH, cwd); rounds alternate A B A B, each model in turn. Caches are as the machine has them (the kernels
built, a GGUF tokenizer converted by an earlier start: pass ``--warm-up`` to start each tree once first).

    .venv/bin/python benchmarks/serve_startup.py --trees ../pagedllm-before . --models default /path/to/hf-folder
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx
from serve_sweep import wait_healthy

PORT = 8250


def start_once(tree: str, model: str) -> dict[str, float]:
    """One start of `pagedllm serve` from ``tree``: the three times, in seconds."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    args = [] if model == "default" else [model]
    url = f"http://127.0.0.1:{PORT}"
    began = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *args, "--port", str(PORT),
                             "--uvicorn-log-level", "warning"], env=env, cwd=os.path.abspath(tree),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # (cwd: `-m` puts it first)
    try:
        wait_healthy(proc, PORT, 300, f"the server from {tree}", poll_s=0.02)
        healthy = time.monotonic() - began
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 1}, timeout=60)
        assert reply.status_code == 200, reply.text
        first = time.monotonic() - began
    finally:
        stopping = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    return {"healthy_s": healthy, "first_reply_s": first, "stop_s": time.monotonic() - stopping}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs=2, required=True, metavar=("A", "B"))
    parser.add_argument("--models", nargs="+", default=["default"], help="'default' or a model path")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm-up", action="store_true", help="start each tree on each model once, untimed")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if args.warm_up:
        for model in args.models:
            for tree in args.trees:
                start_once(tree, model)
    rows = []
    for round_ in range(args.rounds):
        for model in args.models:
            for tree in (args.trees if round_ % 2 == 0 else args.trees[::-1]):
                row = {"tree": tree, "model": model, "round": round_, **start_once(tree, model)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    print("\n| model | tree | to /health (s) | to a first reply (s) | SIGTERM to exit (s) |")
    print("|---|---|---:|---:|---:|")
    for model in args.models:
        for tree in args.trees:
            mine = [r for r in rows if r["tree"] == tree and r["model"] == model]
            med = {k: statistics.median(r[k] for r in mine) for k in ("healthy_s", "first_reply_s", "stop_s")}
            print(f"| {os.path.basename(model)} | {tree} | {med['healthy_s']:.2f} | {med['first_reply_s']:.2f} | "
                  f"{med['stop_s']:.2f} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
