"""Decode throughput of a small Mixtral-shaped random-weight model (8 experts, top-2), at batch 1 and 64,
with the share of the time spent in routing (router GEMM, softmax, top-k, grouping) and in the experts'
GEMMs, measured by timing those calls inside the real engine (the CPU runs them synchronously).

    python benchmarks/moe_step.py [--batches 1 64] [--hidden 512] [--layers 4] [--dtype auto]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.layers import moe  # noqa: E402
from tests.tiny_tokenizer import save_word_tokenizer  # noqa: E402


class Timer:
    """Seconds spent in the wrapped calls."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):  # noqa: ANN001, ANN202
        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    from transformers import MixtralConfig

    folder = Path(tempfile.mkdtemp(prefix="moe-bench-"))
    MixtralConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 7 // 2,
                  num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2, num_local_experts=8,
                  num_experts_per_tok=2, max_position_embeddings=4096,
                  architectures=["MixtralForCausalLM"]).save_pretrained(folder)
    save_word_tokenizer(folder, 32000)
    llm = LLM(str(folder), load_format="dummy", dtype=args.dtype, enable_prefix_caching=False)
    total, experts = Timer(), Timer()
    block_forward, gemm = moe.MoEBlock.forward, moe.expert_gemm
    moe.MoEBlock.forward = total.wrap(block_forward)  # router + routing + experts + all-reduce
    moe.expert_gemm = experts.wrap(gemm)
    print(f"Mixtral-shaped: hidden {args.hidden}, {args.layers} layers, 8 experts (intermediate "
          f"{args.hidden * 7 // 2}), top-2, dtype {args.dtype}; {args.output_len} tokens decoded per request")
    print("| batch | decode tok/s | MoE blocks | of which expert GEMMs | routing and grouping |")
    print("|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for batch in args.batches:
        prompts = [{"prompt_token_ids": torch.randint(3, 32000, (64,), generator=gen).tolist()} for _ in range(batch)]
        llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
        for timer in (total, experts):
            timer.seconds = 0.0
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
        prefill = time.perf_counter() - start
        prefill_moe, prefill_experts = total.seconds, experts.seconds
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=args.output_len, ignore_eos=True), use_tqdm=False)
        decode = time.perf_counter() - start - prefill  # the prompts again, then the decode steps
        moe_s, exp_s = total.seconds - 2 * prefill_moe, experts.seconds - 2 * prefill_experts
        print(f"| {batch} | {batch * (args.output_len - 1) / decode:.1f} | {moe_s / decode:.0%} | "
              f"{exp_s / decode:.0%} | {(moe_s - exp_s) / decode:.0%} |")
    moe.MoEBlock.forward, moe.expert_gemm = block_forward, gemm
    llm.shutdown()


if __name__ == "__main__":
    main()
