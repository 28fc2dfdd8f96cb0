"""Offline throughput and per-rank memory at tensor_parallel_size 1 and 2 (mp, ray) and pipeline_parallel_size 2,
in one run; with --latency, batch-1 latency too.

Runs `pagedllm bench throughput` (and `bench latency`) once per configuration per round, alternating (machines are
noisy: compare within a run), and prints a table of total tokens/s, the batch-1 request's seconds and each rank's
weights, KV pool and RSS. "tp=2 mp gloo" keeps the collectives on gloo (PAGEDLLM_CPU_SHM_ALLREDUCE=0); "pp=2 mp
1-in-flight" runs one batch at a time through the stages (PAGEDLLM_PP_BATCHES_IN_FLIGHT=1). --shape
runs a shape of benchmarks/big_models.py (smollm2-1.7b, llama-8b) with load_format="dummy": its config.json and the
default model's tokenizer are written once under ~/.cache/pagedllm-bench/<shape>/config-only.

    .venv/bin/python benchmarks/tensor_parallel.py --num-prompts 64 --rounds 2 [--dtype auto]
        [--configs tp=1 "tp=2 mp" "tp=2 ray" "tp=2 mp gloo" "pp=2 mp" "pp=2 mp 1-in-flight" "pp=2 tp=2 mp"]
    .venv/bin/python benchmarks/tensor_parallel.py --shape smollm2-1.7b --num-prompts 16 --latency \
        --configs tp=1 "tp=2 mp" "pp=2 mp"
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
           "tp=2 mp gloo": ([*TP2, "mp"], {"PAGEDLLM_CPU_SHM_ALLREDUCE": "0"}),  # collectives over gloo's TCP
           "pp=2 mp": (["--pipeline-parallel-size", "2"], {}),
           "pp=2 mp 1-in-flight": (["--pipeline-parallel-size", "2"], {"PAGEDLLM_PP_BATCHES_IN_FLIGHT": "1"}),
           "pp=2 tp=2 mp": (["--pipeline-parallel-size", "2", "--tensor-parallel-size", "2"], {})}


def shape_folder(shape: str) -> str:
    """A folder with ``shape``'s config.json and the default model's tokenizer (load_format="dummy" reads no
    more), written once (under a .tmp name, renamed when whole)."""
    import shutil

    sys.path.insert(0, str(Path(__file__).parent))
    from big_models import SHAPES, paths

    final = os.path.join(os.path.dirname(paths(shape)["hf"]), "config-only")
    if os.path.exists(os.path.join(final, "config.json")):
        return final
    from pagedllm.models.loader import default_model_path, load_tokenizer

    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = load_tokenizer(default_model_path())
    tokenizer.save_pretrained(tmp)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
              "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, **SHAPES[shape]}
    Path(tmp, "config.json").write_text(json.dumps(config, indent=1))
    os.rename(tmp, final)
    return final


def run_latency(flags: list[str], env: dict[str, str], ns: argparse.Namespace) -> float:
    """Seconds of one batch-1 request (ns.input_len prompt tokens, ns.latency_output_len generated): the median."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [str(Path(sys.executable).with_name("pagedllm")), "bench", "latency", "--batch-size", "1",
               "--input-len", str(ns.input_len), "--output-len", str(ns.latency_output_len), "--num-iters", "3",
               "--num-iters-warmup", "1", "--dtype", ns.dtype, "--output-json", out.name, *ns.model_flags, *flags]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **env})
        return float(json.loads(Path(out.name).read_text())["avg_latency"])


def run_once(flags: list[str], env: dict[str, str], ns: argparse.Namespace) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [str(Path(sys.executable).with_name("pagedllm")), "bench", "throughput", "--dataset-name", "random",
               "--random-input-len", str(ns.input_len), "--random-output-len", str(ns.output_len),
               "--num-prompts", str(ns.num_prompts), "--dtype", ns.dtype, "--output-json", out.name,
               *ns.model_flags, *flags]
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
    parser.add_argument("--shape", default=None, help="a shape of benchmarks/big_models.py, dummy weights")
    parser.add_argument("--kv-cache-memory", default=None, help="per rank, e.g. 2GiB (default: the engine's)")
    parser.add_argument("--latency", action="store_true", help="also batch-1 latency (bench latency)")
    parser.add_argument("--latency-output-len", type=int, default=32)
    ns = parser.parse_args()
    ns.model_flags = [] if ns.shape is None else ["--model", shape_folder(ns.shape), "--load-format", "dummy"]
    ns.model_flags += [] if ns.kv_cache_memory is None else ["--kv-cache-memory", ns.kv_cache_memory]
    results: dict[str, list[dict]] = {name: [] for name in ns.configs}
    latency: dict[str, list[float]] = {name: [] for name in ns.configs}
    for r in range(ns.rounds):
        for name in ns.configs:
            results[name].append(run_once(*CONFIGS[name], ns))
            print(f"round {r + 1} {name}: {results[name][-1]['tokens_per_second']:.1f} tokens/s", flush=True)
            if ns.latency:
                latency[name].append(run_latency(*CONFIGS[name], ns))
                print(f"round {r + 1} {name}: batch-1 latency {latency[name][-1]:.2f} s", flush=True)
    print("\n| config | total tokens/s (per round) | median | batch-1 s (median) "
          "| rank: weights / KV pool / RSS (MiB) |")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        speeds = [run["tokens_per_second"] for run in runs]
        ranks = "; ".join(f"{i}: {m['weights_mib']:.0f} / {m['kv_cache_mib']:.0f} / {m['rss_mib']:.0f}"
                          for i, m in enumerate(runs[-1]["ranks"]))
        lat = f"{statistics.median(latency[name]):.2f}" if latency[name] else "-"
        print(f"| {name} | {', '.join(f'{s:.1f}' for s in speeds)} | {statistics.median(speeds):.1f} | {lat} "
              f"| {ranks} |")


if __name__ == "__main__":
    main()
