"""Offline throughput with LoRA adapters: the base model alone (enable_lora off), the same requests on a
LoRA-enabled engine without adapters, and the requests spread over 4 adapters in the same batches.

Adapters are random PEFT files (rank 16 on every linear layer, written here from the model's shapes),
so the figure measures the cost of the adapters' compute, not their quality.

    python benchmarks/lora_batch.py [--model PATH] [--num-prompts 64] [--input-len 128] [--output-len 128]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm import LLM, LoRARequest, SamplingParams  # noqa: E402
from pagedllm.models.loader import load_arch_config, resolve_model_path  # noqa: E402


def write_adapter(folder: Path, model: str, rank: int, seed: int) -> None:
    """A random PEFT adapter of ``rank`` on q/k/v/o/gate/up/down of every layer."""
    from safetensors.torch import save_file

    arch = load_arch_config(resolve_model_path(model))
    h, d = arch.hidden_size, arch.head_dim
    shapes = {"self_attn.q_proj": (h, arch.num_heads * d), "self_attn.k_proj": (h, arch.num_kv_heads * d),
              "self_attn.v_proj": (h, arch.num_kv_heads * d), "self_attn.o_proj": (arch.num_heads * d, h),
              "mlp.gate_proj": (h, arch.intermediate_size), "mlp.up_proj": (h, arch.intermediate_size),
              "mlp.down_proj": (arch.intermediate_size, h)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for module, (fan_in, fan_out) in shapes.items():
            stem = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
            tensors[f"{stem}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": [m.split(".")[1] for m in shapes]}))


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, loras: list[LoRARequest | None]) -> float:
    """Total tokens (in + out) per second of one generate call."""
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
    return tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    vocab = load_arch_config(resolve_model_path(args.model)).vocab_size
    prompts = [torch.randint(100, vocab, (args.input_len,), generator=gen).tolist() for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    folder = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    adapters = []
    for i in range(4):
        write_adapter(folder / f"a{i}", args.model, args.rank, seed=i)
        adapters.append(LoRARequest(f"a{i}", i + 1, str(folder / f"a{i}")))
    results = {}
    base = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False)
    run(base, prompts[:4], SamplingParams(max_tokens=4), [None] * 4)  # warm-up
    results["base model, enable_lora off"] = run(base, prompts, params, [None] * len(prompts))
    base.shutdown()
    lora = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False, enable_lora=True, max_loras=4,
               max_lora_rank=args.rank)
    run(lora, prompts[:4], SamplingParams(max_tokens=4), adapters)  # warm-up, adapters read
    results["enable_lora, no adapter"] = run(lora, prompts, params, [None] * len(prompts))
    results["enable_lora, 4 adapters mixed"] = run(lora, prompts, params,
                                                   [adapters[i % 4] for i in range(len(prompts))])
    lora.shutdown()
    first = results["base model, enable_lora off"]
    print(f"\n{args.num_prompts} prompts x ({args.input_len} in, {args.output_len} out), rank {args.rank}")
    print("| run | total tok/s | vs base |\n|---|---:|---:|")
    for name, value in results.items():
        print(f"| {name} | {value:.0f} | {value / first:.2f}x |")


if __name__ == "__main__":
    main()
