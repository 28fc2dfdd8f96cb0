"""The AMX GEMM of decode steps (csrc/gemm_amx.cpp, the "amx" level) over one layer's matrices of a model shape,
the weights read from memory (eight layers' copies, past the last-level cache), against F.linear (oneDNN) on the
same plain weights: milliseconds for the eight layers and the weight bytes read per second, beside a streaming
read of a buffer as large. Best of 5 passes.

    .venv/bin/python benchmarks/amx_gemm.py                    # the SmolLM2-1.7B shape, 1 / 16 / 32 rows
    .venv/bin/python benchmarks/amx_gemm.py --rows 8 24 --hidden 4096 --intermediate 14336 --kv-dim 1024

Only where this CPU (or PAGEDLLM_ISA) is at the amx level.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pagedllm.layers import cpu_ops


def best_s(fn, passes: int = 5) -> float:  # noqa: ANN001
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32], help="rows of x (at most 32)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--kv-dim", type=int, default=2048, help="KV heads x head_dim")
    parser.add_argument("--layers", type=int, default=8, help="copies cycled through (past the cache)")
    args = parser.parse_args()
    ops = cpu_ops.kernels("amx")
    if ops is None or not ops.amx:
        raise SystemExit("no amx level on this CPU (or under PAGEDLLM_ISA)")
    h, i = args.hidden, args.intermediate
    shapes = [(h + 2 * args.kv_dim, h), (h, h), (2 * i, h), (h, i)]  # qkv, o, gate_up, down: (out, in)
    weights = [[torch.randn(n, k).bfloat16() for n, k in shapes] for _ in range(args.layers)]
    nbytes = sum(n * k * 2 for n, k in shapes) * args.layers
    buffer = torch.ones(nbytes // 4)
    read = nbytes / best_s(buffer.sum) / 1e9
    print(f"{torch.get_num_threads()} threads, {nbytes / 1e9:.2f} GB of bf16 weights, streaming read {read:.1f} GB/s")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k).bfloat16() for _, k in shapes}
        outs = {n: torch.empty(rows, n, dtype=torch.bfloat16) for n, _ in shapes}

        def amx(xs: dict = xs, outs: dict = outs) -> None:
            for layer in weights:
                for (n, k), w in zip(shapes, layer):
                    ops.amx_gemm(xs[k], w, outs[n])

        def onednn(xs: dict = xs) -> None:
            for layer in weights:
                for (_, k), w in zip(shapes, layer):
                    F.linear(xs[k], w)

        a, o = best_s(amx), best_s(onednn)
        print(f"  {rows:3d} rows: AMX GEMM {a * 1e3:6.1f} ms ({nbytes / a / 1e9:5.1f} GB/s), "
              f"F.linear {o * 1e3:6.1f} ms ({nbytes / o / 1e9:5.1f} GB/s)")


if __name__ == "__main__":
    main()
