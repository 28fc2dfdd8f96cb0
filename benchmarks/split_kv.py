"""Split-KV decode attention: one layer's batch-1 paged attention over a long context, with the automatic split
(csrc/attention.h: tasks too few for the threads are cut into pieces of KV blocks) against no split, at the
active kernel level, bf16 and int8 caches, blocks of 16 in random order. Llama-3.1-8B's shape by default (32 query
heads on 8 KV heads, head_dim 128), and 4 query heads on 1 KV head, where a single task leaves every thread but
one idle without the split. Each timed call runs as many layers (each its own blocks of one shared cache) as
outgrow the last-level cache (--stream-mib), so K/V come from memory as in a real step; ms per layer. The two
modes alternate call by call; best and median of --calls each, after warm-up (best: the figure least disturbed
by other work on the cores).

    .venv/bin/python benchmarks/split_kv.py --threads 2 [--contexts 4096 16384 32768] [--kv-heads 8 1]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from pagedllm.layers.cpu_ops import active  # noqa: E402
from tests.attention.test_kv_int8 import int8_cache  # noqa: E402

GROUP = 4  # query heads per KV head (Llama-3.1-8B's)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[8, 1])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--caches", nargs="+", default=["bf16", "int8"], choices=["bf16", "int8", "float32"])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--stream-mib", type=float, default=96, help="K/V read per timed call (beyond the LLC)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = active()
    assert kernels is not None, "no compiled kernels on this machine"
    print(f"level {kernels.level}, {args.threads} threads, head_dim {args.head_dim}, {GROUP} query heads a KV head; "
          "ms per layer (best / median), KV GB/s read at the best")
    bs, d = 16, args.head_dim
    g = torch.Generator().manual_seed(0)
    for nkv in args.kv_heads:
        for context in args.contexts:
            blocks = -(-context // bs)
            layer_mib = blocks * bs * nkv * d * 2 * 2 / 2**20  # K + V of one layer in bf16
            layers = max(1, min(64, round(args.stream_mib / layer_mib)))
            perm = (torch.randperm(layers * blocks, generator=g) + 1).to(torch.int32)  # scattered blocks
            tables = [perm[i * blocks:(i + 1) * blocks].view(1, blocks) for i in range(layers)]  # (1, blocks) each
            lens = torch.tensor([context], dtype=torch.int32)
            floats = torch.randn(TorchAttentionBackend.kv_cache_shape(layers * blocks + 1, bs, nkv, d), generator=g)
            for name in args.caches:
                cache = int8_cache(floats) if name == "int8" else floats.to(
                    torch.bfloat16 if name == "bf16" else torch.float32)
                dtype = torch.float32 if name == "float32" else torch.bfloat16
                q = torch.randn(1, nkv * GROUP, d, generator=g).to(dtype)
                out = torch.empty_like(q)
                times: dict[bool | None, list[float]] = {None: [], False: []}
                for i in range(args.calls + 2):
                    for split in times:
                        start = time.perf_counter()
                        for table in tables:
                            kernels.paged_attention(q, cache[0], cache[1], table, lens, out, d ** -0.5, split=split)
                        if i >= 2:  # warm-up calls
                            times[split].append((time.perf_counter() - start) / layers)
                best = {split: min(t) * 1e3 for split, t in times.items()}
                median = {split: statistics.median(t) * 1e3 for split, t in times.items()}
                gbs = cache[:, 1:].nbytes / layers / 1e9 / (best[None] / 1e3)
                pieces = kernels.attention_split_pieces(lens, nkv, bs)
                print(f"  {nkv} KV heads, {context:>6} tokens, {name:>7} ({pieces:>2} pieces, {layers:>2} layers): "
                      f"split {best[None]:7.3f} / {median[None]:7.3f} ms ({gbs:5.1f} GB/s), "
                      f"unsplit {best[False]:7.3f} / {median[False]:7.3f} ms: "
                      f"{best[False] / best[None]:.2f}x / {median[False] / median[None]:.2f}x")


if __name__ == "__main__":
    main()
