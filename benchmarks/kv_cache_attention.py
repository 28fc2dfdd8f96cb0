"""One layer's paged attention (the cpu backend: K/V slot writes + attention) over a bf16 cache and over the
int8 cache (kv_cache_dtype="int8"), decode batches of the default model's shape (9 query / 3 KV heads,
head_dim 64, blocks of 16, scattered), at the active kernel level (PAGEDLLM_ISA forces a lower one).
Best of 10 calls after 3 warm-up calls, the two caches alternating in one process.

    OMP_NUM_THREADS=2 python benchmarks/kv_cache_attention.py [--shapes 64x512 8x2048 256x200]
    OMP_NUM_THREADS=2 python benchmarks/kv_cache_attention.py --shapes 32x192 1x128 --heads 32 --kv-heads 32
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm import platform  # noqa: E402
from pagedllm.attention.cpu_backend import CpuAttentionBackend  # noqa: E402
from pagedllm.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from tests.attention.batches import make_step  # noqa: E402
from tests.attention.test_kv_int8 import int8_cache  # noqa: E402


def best_ms(fn, calls: int = 10) -> float:  # noqa: ANN001
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["64x512", "8x2048", "256x200"],
                        help="decode batches as SEQUENCESxCONTEXT")
    parser.add_argument("--heads", type=int, default=9, help="query heads (32 and --kv-heads 32: the 1.7B shape)")
    parser.add_argument("--kv-heads", type=int, default=3)
    args = parser.parse_args()
    print(platform.describe("bfloat16"))
    torch.manual_seed(0)
    backend = CpuAttentionBackend()
    for shape in args.shapes:
        seqs, context = (int(x) for x in shape.split("x"))
        block_size = 16
        blocks = seqs * -(-context // block_size) + 8
        step = make_step([context] * seqs, 0, block_size=block_size, num_blocks=blocks, seed=1)
        floats = torch.randn(TorchAttentionBackend.kv_cache_shape(blocks, block_size, args.kv_heads, 64))
        q, k, v = (torch.randn(seqs, h, 64).bfloat16() for h in (args.heads, args.kv_heads, args.kv_heads))
        metadata = backend.make_builder().build(step)
        caches = {"bf16": CpuAttentionBackend.to_kernel_layout(floats.bfloat16()), "int8": int8_cache(floats)}
        ms = {name: best_ms(lambda c=cache, q=q, k=k, v=v, md=metadata: backend.forward(q, k, v, c, md, 0.125))
              for name, cache in caches.items()}
        size = {name: cache.nbytes / 2**20 for name, cache in caches.items()}
        print(f"{seqs} x {context} tokens: bf16 {ms['bf16']:.2f} ms ({size['bf16']:.0f} MiB), "
              f"int8 {ms['int8']:.2f} ms ({size['int8']:.0f} MiB) per layer")


if __name__ == "__main__":
    main()
