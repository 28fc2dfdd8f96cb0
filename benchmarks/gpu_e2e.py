"""End-to-end checks of the GPU path with random-weight models built here (no checkpoint travels):

    python benchmarks/gpu_e2e.py greedy   # tiny random Llama: our greedy tokens == transformers' (float32),
                                          # with CUDA graphs and with enforce_eager
    python benchmarks/gpu_e2e.py decode [--batches 1 16 64 256] [--shape llama3-8b]
                                          # decode tokens/s of a random-weight model (load_format="dummy",
                                          # bfloat16, 128 in / 128 out, ignore_eos) next to its roofline
    python benchmarks/gpu_e2e.py spec     # speculative decoding on the device: tiny random Llama, greedy and
                                          # seeded tokens with ngram / a draft model == without; then the
                                          # dummy-weight model's decode tokens/s with and without ngram drafts

The roofline of a decode step is the bytes it must read (every weight but the input embedding, plus
the K/V of every sequence's context, at its mean length over the run) divided by the copy bandwidth
measured in the same process; tokens/s = batch / that time. Decode time = the whole run less a
max_tokens=1 run (the prefill). Without CUDA both run on the CPU (``--shape tiny``: the dry run of
benchmarks/gpu_check.sh). Prints a markdown table last.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.tiny_tokenizer import save_word_tokenizer  # noqa: E402

SHAPES = {  # transformers LlamaConfig fields
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                      tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False),
}


def save_config(path: Path, shape: str) -> object:
    from transformers import LlamaConfig

    config = LlamaConfig(**SHAPES[shape], rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, initializer_range=0.1)
    config.save_pretrained(path)
    save_word_tokenizer(path, config.vocab_size)
    return config


def _graph_replays(worker: object) -> int:
    """Decode steps a worker ran as CUDA graph replays (collective_rpc runs this on the worker)."""
    graphs = worker.model_runner.graphs
    return sum(graphs.replays.values()) if graphs else 0


def greedy(device: str) -> dict:
    """A tiny random Llama (float32) saved by transformers: ours vs HF generate, greedy, on ``device``."""
    from transformers import LlamaForCausalLM

    from pagedllm import LLM, SamplingParams

    folder = Path(tempfile.mkdtemp(prefix="gpu-greedy-"))
    config = save_config(folder, "tiny")
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    hf = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).to(device).eval()
    prompts = [[1 + i, 50 + 7 * i, 9, 300 + i, 17, 2 * i + 3] * (1 + i % 3) for i in range(8)]
    want = []
    with torch.no_grad():  # plain greedy over full forwards: no generate() rules (EOS, min tokens) in the way
        for p in prompts:
            ids = torch.tensor([p], device=device)
            for _ in range(16):
                ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            want.append(ids[0, len(p):].tolist())
    result = {}
    for eager in (False, True):
        llm = LLM(str(folder), dtype="float32", device=device, enforce_eager=eager, num_kv_blocks=256,
                  max_model_len=512, max_num_seqs=8, cuda_graph_sizes="1,2,4,8")
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                              use_tqdm=False)]
        name = "greedy_vs_transformers_" + ("eager" if eager else "graphs")
        result[name] = {"equal": got == want, "graph_replays": llm.collective_rpc(_graph_replays)[0]}
        print(name, result[name], flush=True)
        llm.shutdown()
    return result


def spec(device: str, shape: str, batches: list[int]) -> dict:
    """Speculative decoding on ``device``: the tiny model's tokens with ngram and draft-model speculation equal
    those without (greedy, and seeded sampling); then decode tokens/s of ``shape`` with dummy weights (whose
    output repeats one token, so prompt lookup's drafts are all accepted: the best case, and the cost of a step
    that verifies 5 drafts against a plain one)."""
    from pagedllm import LLM, SamplingParams

    folder = Path(tempfile.mkdtemp(prefix="gpu-spec-"))
    config = save_config(folder, "tiny")
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM
    LlamaForCausalLM(config).save_pretrained(folder)
    prompts = [{"prompt_token_ids": [1 + i, 50 + 7 * i, 9, 300 + i, 17, 2 * i + 3] * (2 + i % 3)} for i in range(8)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, top_k=20, seed=3, ignore_eos=True)]
    result: dict = {}
    got = {}
    for name, cfg in (("none", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 4,
                                                 "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                                                 "disable_by_batch_size": None}),
                      ("draft", {"model": str(folder), "num_speculative_tokens": 3, "disable_by_batch_size": None})):
        llm = LLM(str(folder), dtype="float32", device=device, num_kv_blocks=256, max_model_len=512,
                  speculative_config=cfg)
        got[name] = [[o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)] for p in params]
        stats = llm.get_stats()
        result[f"check_{name}"] = {"equal_to_none": got[name] == got["none"],
                                  "accepted": stats.spec_decode_num_accepted_tokens,
                                  "drafted": stats.spec_decode_num_draft_tokens}
        print(f"check_{name}", result[f"check_{name}"], flush=True)
        llm.shutdown()
    big = Path(tempfile.mkdtemp(prefix=f"gpu-spec-{shape}-"))
    save_config(big, shape)
    dtype = "bfloat16" if device == "cuda" else "float32"
    rng = torch.Generator().manual_seed(0)
    for name, cfg in (("none", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 5,
                                                 "prompt_lookup_min": 2, "prompt_lookup_max": 4,
                                                 "disable_by_batch_size": None})):
        llm = LLM(str(big), load_format="dummy", dtype=dtype, device=device, max_num_seqs=max(batches),
                  max_model_len=128 + 256 + 16, enable_prefix_caching=False, speculative_config=cfg)
        for batch in batches:
            prompts = [{"prompt_token_ids": torch.randint(3, SHAPES[shape]["vocab_size"], (128,),
                                                          generator=rng).tolist()} for _ in range(batch)]
            sp = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
            llm.generate(prompts[:1], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
            before = llm.get_stats()
            _sync(device)
            t = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            _sync(device)
            elapsed = time.perf_counter() - t
            after = llm.get_stats()
            steps = after.num_steps - before.num_steps
            row = {"tok_s": round(batch * 256 / elapsed, 1), "steps": steps,
                   "ms_per_step": round(1000 * elapsed / steps, 2),
                   "accepted": after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens}
            result[f"{shape}_{name}_batch{batch}"] = row
            print(f"{shape}_{name}_batch{batch}", row, flush=True)
        llm.shutdown()
        del llm  # its weights and KV pool go before the next engine takes its share of the device
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return result


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted), median of 10."""
    n = (1 << 30) if device == "cuda" else (1 << 27)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * n / sorted(times[2:])[len(times[2:]) // 2]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def decode(device: str, shape: str, batches: list[int], prompt_len: int, output_len: int, eager: bool) -> list[dict]:
    """Decode tokens/s at each batch size, with its roofline."""
    from pagedllm import LLM, SamplingParams

    folder = Path(tempfile.mkdtemp(prefix=f"gpu-{shape}-"))
    config = save_config(folder, shape)
    dtype = "bfloat16" if device == "cuda" else "float32"
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    start = time.perf_counter()
    llm = LLM(str(folder), load_format="dummy", dtype=dtype, device=device, enforce_eager=eager,
              max_num_seqs=max(batches), max_model_len=prompt_len + output_len + 16, enable_prefix_caching=False)
    print(f"engine up in {time.perf_counter() - start:.1f} s", flush=True)
    itemsize = torch.finfo(getattr(torch, dtype)).bits // 8
    model = llm.apply_model(lambda m: m)[0]  # in-process: the module itself
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    head_dim = config.hidden_size // config.num_attention_heads
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * itemsize
    rng = torch.Generator().manual_seed(0)
    rows = []

    def run(batch: int, max_tokens: int) -> float:
        prompts = [{"prompt_token_ids": torch.randint(3, config.vocab_size, (prompt_len,), generator=rng).tolist()}
                   for _ in range(batch)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        _sync(device)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        _sync(device)
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        return time.perf_counter() - t

    run(min(batches), 4)  # warm-up: prefill kernels compile
    for batch in batches:
        prefill = run(batch, 1)
        total = run(batch, output_len)
        tok_s = batch * (output_len - 1) / (total - prefill)
        step_bytes = weight_bytes + batch * (prompt_len + output_len / 2) * kv_per_token
        roofline = batch * bandwidth / step_bytes
        row = {"shape": shape, "dtype": dtype, "batch": batch, "cuda_graphs": not eager and device == "cuda",
               "decode_tok_s": round(tok_s, 1), "roofline_tok_s": round(roofline, 1),
               "of_roofline": round(tok_s / roofline, 3), "prefill_s": round(prefill, 3)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    llm.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["greedy", "decode", "spec"])
    parser.add_argument("--shape", choices=list(SHAPES), default=None,
                        help="model shape (default: llama3-8b on CUDA, tiny on a CPU)")
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.what == "greedy":
        result = greedy(device)
        assert all(r["equal"] for r in result.values()), result
        assert device != "cuda" or result["greedy_vs_transformers_graphs"]["graph_replays"] > 0, "no graph replayed"
        print("ALL OK")
        return
    shape = args.shape or ("llama3-8b" if device == "cuda" else "tiny")
    if args.what == "spec":
        result = spec(device, shape, args.batches or [1, 16])
        assert all(r["equal_to_none"] for k, r in result.items() if k.startswith("check_")), result
        print("ALL OK")
        return
    batches = args.batches or ([1, 16, 64, 256] if device == "cuda" else [1, 4])
    rows = decode(device, shape, batches, args.prompt_len, args.output_len, args.enforce_eager)
    print("\n| shape | dtype | CUDA graphs | batch | decode tok/s | roofline tok/s | of roofline |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['dtype']} | {r['cuda_graphs']} | {r['batch']} | {r['decode_tok_s']} | "
              f"{r['roofline_tok_s']} | {r['of_roofline'] * 100:.0f}% |")


if __name__ == "__main__":
    main()
