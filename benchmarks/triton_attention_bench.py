"""Paged attention (the triton backend's kernels) vs torch SDPA (FlashAttention on CUDA) on the same K/V
stored contiguously: decode steps of a Llama-3-8B-shaped layer (32 heads, 8 KV heads, head_dim 128,
bf16, block size 16), the paper's kernel-overhead comparison (it measured 20-26%; the goal here is
under 10%). Needs a CUDA device; elsewhere it says so and exits 0 (benchmarks/gpu_check.sh's CPU
fallback).

    python benchmarks/triton_attention_bench.py [--batches 1 16 64 256] [--context 1024]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def time_cuda(fn, iters: int = 50) -> float:
    """Median milliseconds of ``fn`` on the current stream."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def one(batch: int, context: int, splits: int | None) -> tuple[float, float]:
    """(paged ms, contiguous SDPA ms) for one decode step of ``batch`` sequences of ``context`` tokens."""
    from pagedllm.attention import triton_ops
    dev, dt = torch.device("cuda"), torch.bfloat16
    blocks_per_seq = context // BLOCK
    num_blocks = batch * blocks_per_seq + 1
    cache = torch.randn(2, num_blocks, KV_HEADS, BLOCK, HEAD_DIM, device=dev, dtype=dt)
    tables = (torch.randperm(num_blocks - 1, device=dev)[:batch * blocks_per_seq] + 1).view(batch, blocks_per_seq)
    tables = tables.to(torch.int32).contiguous()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=dev, dtype=dt)
    out = torch.empty_like(q)
    scale = HEAD_DIM ** -0.5
    block_q = triton_ops.block_q_for(HEADS, KV_HEADS)
    work_req = torch.arange(batch, dtype=torch.int32, device=dev)
    work_qblock = torch.zeros(batch, dtype=torch.int32, device=dev)
    if splits and splits > 1:
        paged = time_cuda(lambda: triton_ops.split_decode_attention(q, cache, tables, seq_lens, splits, scale, out))
    else:
        paged = time_cuda(lambda: triton_ops.varlen_attention(q, cache, tables, seq_lens, qsl, work_req, work_qblock,
                                                              block_q, scale, out))
    # the same keys and values, contiguous per sequence: (batch, kv_heads, context, head_dim)
    k = cache[0][tables.long()].permute(0, 2, 1, 3, 4).reshape(batch, KV_HEADS, context, HEAD_DIM).contiguous()
    v = cache[1][tables.long()].permute(0, 2, 1, 3, 4).reshape(batch, KV_HEADS, context, HEAD_DIM).contiguous()
    qs = q.unsqueeze(2)  # (batch, heads, 1, head_dim)
    sdpa = time_cuda(lambda: F.scaled_dot_product_attention(qs, k, v, scale=scale, enable_gqa=True))
    ref = F.scaled_dot_product_attention(qs, k, v, scale=scale, enable_gqa=True).squeeze(2)
    err = (ref.float() - out.float()).abs().max().item()
    assert err < 5e-2, f"paged and contiguous results differ by {err}"
    return paged, sdpa


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--context", type=int, default=1024)
    ns = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: the kernel timing needs one (the kernels' correctness is checked on CPU by "
              "tests/attention/test_triton_backend.py)")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; decode, {HEADS} heads / {KV_HEADS} KV heads, "
          f"head_dim {HEAD_DIM}, bf16, block {BLOCK}, context {ns.context}")
    print("| batch | kernel | paged ms | contiguous SDPA ms | paged / SDPA |")
    print("|---|---|---|---|---|")
    for batch in ns.batches:
        for splits in (1, 4):
            paged, sdpa = one(batch, ns.context, splits)
            print(f"| {batch} | {'varlen' if splits == 1 else f'split-K x{splits}'} | {paged:.4f} | {sdpa:.4f} | "
                  f"{paged / sdpa:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
