"""The compiled paged-attention kernel with several query rows: what a verifying step of speculative decoding
pays for attention. One row, ``--rows`` rows of one request (consecutive positions, one block table), and as many
rows of different requests, over ``--layers`` separate caches evicted from the CPU caches before each pass (as in
a real step, where each layer's K/V comes from memory):

    .venv/bin/python benchmarks/attention_rows.py --context 500 --rows 6

Shape of SmolLM2-135M by default (9 query heads, 3 KV heads, head_dim 64, bf16 where the CPU has it).
"""
from __future__ import annotations

import argparse
import time

import torch

from pagedllm.layers.cpu_ops import active


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=500)
    parser.add_argument("--rows", type=int, default=6)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--passes", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    kernels = active()
    assert kernels is not None, "no compiled kernels on this machine"
    torch.manual_seed(0)
    dtype = torch.bfloat16 if kernels.level != "portable" else torch.float32
    bs, blocks = args.block_size, (args.context + args.rows) // args.block_size + 2
    total = blocks * args.rows + 1
    shape = (total, args.kv_heads, bs, args.head_dim)  # (blocks, kv heads, block size, head_dim) per layer
    caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(args.layers)]
    perm = torch.randperm(total - 1).to(torch.int32) + 1  # blocks in random order, as a pool hands them out
    evict = torch.empty(64 << 20, dtype=torch.uint8)

    def run(rows: int, same: bool) -> float:
        tables = torch.stack([perm[:blocks] if same else perm[r * blocks:(r + 1) * blocks] for r in range(rows)])
        lens = torch.tensor([args.context + (r if same else 0) for r in range(rows)], dtype=torch.int32)
        q = torch.randn(rows, args.heads, args.head_dim).to(dtype)
        out = torch.empty_like(q)
        spent = 0.0
        for _ in range(args.passes):
            evict.add_(1)  # the layers' K/V leave the CPU caches
            start = time.perf_counter()
            for kc, vc in caches:
                kernels.paged_attention(q, kc, vc, tables.contiguous(), lens, out, args.head_dim ** -0.5)
            spent += time.perf_counter() - start
        return spent / args.passes * 1e3

    print(f"level {kernels.level}, {dtype}, context {args.context}, {args.layers} layers, ms per pass:")
    print(f"  1 row: {run(1, True):.2f}")
    print(f"  {args.rows} rows of one request: {run(args.rows, True):.2f}")
    print(f"  {args.rows} rows of {args.rows} requests: {run(args.rows, False):.2f}")


if __name__ == "__main__":
    main()
