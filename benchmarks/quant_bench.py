"""Quantized GGUF weights against llama.cpp on the same files, in one run with engines alternating:
single-request decode next to its memory roofline, batched throughput, and peak RSS.

    .venv/bin/python benchmarks/quant_bench.py --rounds 2
    .venv/bin/python benchmarks/quant_bench.py --parts single --rounds 3 --engines pagedllm-Q4_1 llama.cpp-Q4_1

Engines (--engines): pagedllm-Q4_1 (the default model's own GGUF, quantization="gguf"), pagedllm-Q8_0
(a Q8_0 copy made by llama.cpp's quantizer, quantization="gguf"), pagedllm-bf16 (the default GGUF
dequantized to bfloat16: today's default), and llama.cpp-Q4_1 / -Q8_0 / -BF16 on the same files
(../shared/peers/llama-cpp, llama-cpp-python built for this CPU).

Parts (--parts):
  single   one sequence, the same 128 random prompt ids (numpy seed 0, ids 1000..40000) for every
           engine, --gen (256) greedy tokens, EOS ignored, decode timed from the first generated
           token to the last. pagedllm reports its roofline: the bytes one decode step reads (every
           matmul weight once, as stored: quantized rows, packed bf16) divided by the copy bandwidth
           measured in the same process just before (a 1 GiB float32 copy_, best of 5).
  batched  random 128 in / 128 out x 256: `pagedllm bench throughput` (temperature 1.0, EOS ignored)
           and llama.cpp's batched mode (64 sequences per llama_decode, greedy), total tokens/s.
  perplexity  on tests/data/prose.txt (3,133 tokens of public-domain prose, our tokenizer's ids given
           to both), windows of 512 tokens: `pagedllm bench perplexity` and benchmarks/llamacpp_perplexity.py.
Every run's peak RSS is its process's (GNU time's maximum resident set size; pagedllm's single run:
getrusage just before the bandwidth probe, whose two 1 GiB tensors would count otherwise).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from compare import engine_env  # noqa: E402  (benchmarks/ is not a package)
from isa_levels import LLAMA_CPP, SINGLE, gguf_files  # noqa: E402

ENGINES = ["pagedllm-Q4_1", "pagedllm-Q8_0", "pagedllm-bf16", "llama.cpp-Q4_1", "llama.cpp-Q8_0", "llama.cpp-BF16"]


def files() -> dict[str, str]:
    from pagedllm.models.loader import default_model_path

    return {"Q4_1": default_model_path(), **gguf_files()}


def _result(stdout: str) -> dict:
    """The RESULT {json} line of the peers' scripts, or the JSON line `pagedllm bench` prints."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT ") or line.startswith("{"):
            return json.loads(line.removeprefix("RESULT "))
    raise SystemExit(f"no result in:\n{stdout[-2000:]}")


def timed(cmd: list[str], env: dict[str, str]) -> tuple[dict, float]:
    """Run ``cmd`` under GNU time: its RESULT line and its peak RSS in MiB."""
    with tempfile.NamedTemporaryFile(suffix=".txt") as rss:
        proc = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", rss.name, *cmd], capture_output=True, text=True,
                              env=env, cwd=ROOT)
        if proc.returncode != 0:
            raise SystemExit(f"{cmd[:4]} failed:\n{proc.stderr[-3000:]}")
        return _result(proc.stdout), int(open(rss.name).read().split()[-1]) / 1024


PROSE = os.path.join(ROOT, "tests", "data", "prose.txt")


def command(engine: str, part: str, ggufs: dict[str, str], prompt_file: str, gen: int) -> list[str]:
    kind, fmt = engine.split("-")
    if kind == "llama.cpp" and part == "perplexity":
        return [LLAMA_CPP, "python", os.path.join(ROOT, "benchmarks", "llamacpp_perplexity.py"), "--gguf", ggufs[fmt],
                "--tokens", os.path.join(os.path.dirname(prompt_file), "prose_ids.json")]
    if kind == "llama.cpp":
        work = (["--mode", "single", "--prompts", prompt_file, "--num-prompts", "1", "--gen", str(gen)]
                if part == "single" else ["--mode", "batched", "--parallel", "64", "--num-prompts", "256"])
        return [LLAMA_CPP, "bench", "--gguf", ggufs[fmt], *work]
    model = ggufs["Q4_1" if fmt == "bf16" else fmt]
    quant, dtype = ("none", "bfloat16") if fmt == "bf16" else ("gguf", "auto")
    if part == "single":
        # isa_levels' decode script; a 256 MiB KV pool: peak RSS is the weights and a pool that fits the sequence
        return [sys.executable, "-c", SINGLE, prompt_file, str(gen), model, quant, dtype, "256MiB"]
    flags = ["--quantization", "gguf"] if quant == "gguf" else []
    if part == "perplexity":
        return [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "perplexity", "--file", PROSE, "--model",
                model, "--dtype", dtype, *flags, "--kv-cache-memory", "256MiB"]
    return [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "throughput", "--model", model, "--dtype", dtype,
            *flags, "--input-len", "128", "--output-len", "128", "--num-prompts", "256",
            "--kv-cache-memory", "1.5GiB"]  # all 256 sequences at once (23 KB a token), not the 4 GiB default


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", nargs="+", default=ENGINES, choices=ENGINES)
    ap.add_argument("--parts", nargs="+", default=["single", "batched", "perplexity"],
                    choices=["single", "batched", "perplexity"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gen", type=int, default=256)
    args = ap.parse_args()
    ggufs = files()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file = os.path.join(tmp, "prompt.json")
        with open(prompt_file, "w") as f:
            json.dump([np.random.default_rng(0).integers(1000, 40000, 128).tolist()], f)
        from pagedllm.models.loader import load_tokenizer

        with open(os.path.join(tmp, "prose_ids.json"), "w") as f, open(PROSE, encoding="utf-8") as text:
            json.dump(load_tokenizer(ggufs["Q4_1"]).encode(text.read(), add_special_tokens=False), f)
        for part in args.parts:
            for rnd in range(args.rounds):
                for engine in args.engines:  # alternating: every engine once per round
                    env = engine_env("pagedllm", os.environ.get("PAGEDLLM_ISA")) if engine.startswith("pagedllm") \
                        else dict(os.environ)
                    result, rss = timed(command(engine, part, ggufs, prompt_file, args.gen), env)
                    if "peak_rss_kib" in result:  # pagedllm's single run: its peak before the bandwidth probe
                        rss = result["peak_rss_kib"] / 1024
                    row = {"part": part, "round": rnd, "engine": engine, "peak_rss_mib": round(rss)}
                    if part == "single":
                        row["decode_tok_per_s"] = round(result["decode_tok_per_s"], 1)
                        if "copy_gbps" in result:
                            roof = result["copy_gbps"] * 1e9 / result["weight_bytes"]
                            row.update(copy_gbps=round(result["copy_gbps"], 1),
                                       weight_mb=round(result["weight_bytes"] / 1e6, 1),
                                       roofline_tok_per_s=round(roof, 1),
                                       of_roofline=round(result["decode_tok_per_s"] / roof, 3))
                    elif part == "perplexity":
                        row["perplexity"] = round(result["perplexity"], 3)
                    else:
                        row["total_tok_per_s"] = round(result.get("total_tok_per_s") or result["tokens_per_second"], 1)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print("\n| part | round | engine | tok/s (perplexity) | copy GB/s | weights MB | roofline tok/s | % of roofline "
          "| peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        value = r.get("decode_tok_per_s", r.get("total_tok_per_s", r.get("perplexity")))
        roof = (f"{r['copy_gbps']} | {r['weight_mb']} | {r['roofline_tok_per_s']} | {100 * r['of_roofline']:.0f}%"
                if "copy_gbps" in r else " | | ")
        print(f"| {r['part']} | {r['round']} | {r['engine']} | {value} | {roof} | {r['peak_rss_mib']} |")


if __name__ == "__main__":
    main()
