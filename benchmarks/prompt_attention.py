"""One layer's attention for one fresh prompt, as a prefill step runs it: the compiled paged-attention kernel in
prompt tiles (the default), row by row (``tiles=False``), and torch's causal SDPA on the same q/k/v laid out densely
(what the prompt would cost without a paged cache). Times are the median of ``--passes`` calls, ms:

    .venv/bin/python benchmarks/prompt_attention.py --prompt 4096                          # SmolLM2-1.7B's shape
    .venv/bin/python benchmarks/prompt_attention.py --prompt 4096 --kv-heads 8 --head-dim 128  # Llama-3.1-8B's
    .venv/bin/python benchmarks/prompt_attention.py --prompt 4096 --no-rows                # skip the slow row path
    .venv/bin/python benchmarks/prompt_attention.py --prompt 4096 --kv-cache-dtype int8    # the int8 KV cache

bf16 where the CPU has bf16 dot products (else float32); K/V blocks in random order, as a pool hands them out.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pagedllm.attention import kv_quant
from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.layers.cpu_ops import active
from pagedllm.platform import active_level


def _median_ms(fn, passes: int) -> float:
    fn()  # warm-up: scratch buffers, page faults
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=4096, help="prompt tokens (one chunk)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--no-rows", action="store_true", help="leave out the row-by-row path (minutes at 4k)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto",
                        help="int8: the same K/V quantized into the int8 cache (csrc/kv_int8.cpp)")
    args = parser.parse_args()
    kernels = active()
    assert kernels is not None, "no compiled kernels on this machine"
    torch.manual_seed(0)
    dtype = torch.bfloat16 if kernels.level in ("avx512_bf16", "amx") else torch.float32
    n, bs, d = args.prompt, args.block_size, args.head_dim
    blocks = -(-n // bs)
    cache = torch.randn(TorchAttentionBackend.kv_cache_shape(blocks + 1, bs, args.kv_heads, d)).to(dtype)
    if args.kv_cache_dtype == "int8":  # the same values quantized slot by slot into the int8 layout
        quantized = torch.zeros(TorchAttentionBackend.kv_cache_shape(blocks + 1, bs, args.kv_heads, d, torch.int8),
                                dtype=torch.int8)
        slots = torch.arange((blocks + 1) * bs)
        as_slots = [c.transpose(1, 2).reshape(-1, args.kv_heads, d) for c in cache]  # (slots, kv_heads, d)
        kv_quant.write(quantized, as_slots[0], as_slots[1], slots // bs, slots % bs)
        cache = quantized
    kc, vc = cache[0], cache[1]
    table = (torch.randperm(blocks) + 1).to(torch.int32)
    tables = table.expand(n, blocks).contiguous()  # every row of the prompt reads its request's table
    lens = torch.arange(1, n + 1, dtype=torch.int32)  # row i attends to positions 0..i
    q = torch.randn(n, args.heads, d).to(dtype)
    out = torch.empty_like(q)
    scale = d ** -0.5

    def paged(tiles: bool) -> None:
        kernels.paged_attention(q, kc, vc, tables, lens, out, scale, None, None, tiles=tiles)

    # dense copies for SDPA: (1, heads, n, d), K/V repeated over the query heads of their group
    k = torch.randn(1, args.kv_heads, n, d).to(dtype).repeat_interleave(args.heads // args.kv_heads, dim=1)
    v = torch.randn(1, args.kv_heads, n, d).to(dtype).repeat_interleave(args.heads // args.kv_heads, dim=1)
    qd = q.transpose(0, 1).unsqueeze(0)  # (n, heads, d) -> (1, heads, n, d)

    def sdpa() -> None:
        F.scaled_dot_product_attention(qd, k, v, is_causal=True)

    flops = 4 * n * n / 2 * d * args.heads  # QK and PV over the causal half
    print(f"level {active_level()}, {dtype} ({args.kv_cache_dtype} cache), prompt {n}, {args.heads} heads / "
          f"{args.kv_heads} KV heads of {d}, blocks of {bs}, {torch.get_num_threads()} threads: median ms (GFLOP/s)")
    rows = [("tiles", lambda: paged(True)), ("sdpa", sdpa)] + ([] if args.no_rows else [("rows", lambda: paged(False))])
    for name, fn in rows:
        ms = _median_ms(fn, args.passes if name != "rows" else 1)
        print(f"  {name:6s} {ms:9.1f}  ({flops / ms / 1e6:.0f})")


if __name__ == "__main__":
    main()
