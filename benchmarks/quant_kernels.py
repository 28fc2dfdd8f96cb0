"""The quantized GEMV / GEMM kernels alone (csrc/quant.cpp), per kernel level, format, shape, row count and
thread count: microseconds a call and GB/s of weight bytes read (as the kernels hold them: packed where the
level packs the format).

    .venv/bin/python benchmarks/quant_kernels.py
    .venv/bin/python benchmarks/quant_kernels.py --formats Q4_K Q6_K --rows 1 8 --threads 1 --levels avx512_bf16

Weights are random blocks (scale fields sane). ``--cold`` rotates through copies of the weight that together
exceed the last-level cache (twice its size as sysfs reports it), so each call reads it from memory; otherwise one
copy is read again and again (from the cache where it fits). Times are the fastest and the median of ``--reps``
calls after warm-up (GB/s from the fastest: other work on the machine's cores shows in the median). ``--dense``
also times the same weight dequantized to bf16 through the matmul a bf16 model runs (layers/prepack.py: on AMX
tiles for up to 32 rows at the "amx" level, oneDNN for more), with bf16 rows of x for both: where the quantized
kernels lose to it, the row count above which a dense copy pays (layers/quant.py ``DENSE_ROWS``; ``bf16-dnnp``:
oneDNN's packed layout, the one the copies take).

    .venv/bin/python benchmarks/quant_kernels.py --levels amx --formats Q4_1 --shapes 960x576 3072x576 576x1536 \
        --rows 32 48 64 96 128 256 --threads 2 --dense --cold
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from pagedllm.layers import cpu_ops
from pagedllm.layers.quant import _BLOCKS, GGML_TYPES, QuantTensor

_SCALE_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
                 "Q5_K": (0, 2), "Q6_K": (208,)}
"""Byte offsets of each format's f16 scale fields within a block."""


def random_quant(name: str, rows: int, cols: int, seed: int = 0) -> QuantTensor:
    """A (rows, cols) matrix of random blocks of format ``name``, its f16 scales around 1 / 64."""
    qtype = GGML_TYPES[name]
    block, nbytes = _BLOCKS[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)  # (rows, blocks, bytes)
    for offset in _SCALE_FIELDS[name]:
        scales = rng.uniform(0.5, 1.5, size=data.shape[:2]) / 64
        data[:, :, offset:offset + 2] = scales.astype(np.float16).view(np.uint8).reshape(*data.shape[:2], 2)
    return QuantTensor(qtype, rows, cols, torch.from_numpy(data.reshape(rows, -1)))  # (rows, row bytes)


def cold_bytes() -> int:
    """Bytes of weight copies that together exceed the last-level cache: twice its size as sysfs reports it (300
    MiB on the AMX Xeon we run on, where a fixed 96 MiB rotation read from L3 at twice the memory's rate), at least
    96 MiB."""
    size = 0
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()  # e.g. "300M", "2048K"
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        size = max(size, int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(96 << 20, 2 * size)


def time_call(kernels: cpu_ops.CpuKernels, x: torch.Tensor, weights: list[QuantTensor],
              reps: int) -> tuple[float, float]:
    """The fastest and the median seconds of one qgemm call, cycling through ``weights``."""
    out = torch.empty(x.shape[0], weights[0].rows, dtype=x.dtype)
    for w in weights[:2]:
        kernels.qgemm(x, w, out)
    times = []
    for i in range(reps):
        w = weights[i % len(weights)]
        start = time.perf_counter()
        kernels.qgemm(x, w, out)
        times.append(time.perf_counter() - start)
    return min(times), float(np.median(times))


def read_bandwidth(threads: int) -> float:
    """GB/s of torch's float32 sum over 512 MiB (beyond the last-level cache), best of 8."""
    torch.set_num_threads(threads)
    buf = torch.ones(128 << 20)  # (128 Mi,) float32
    best = min(_timed(buf.sum) for _ in range(8))
    return buf.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", nargs="*", help="kernel levels (default: every one this CPU runs)")
    parser.add_argument("--formats", nargs="*", default=["Q4_1", "Q4_K", "Q5_K", "Q6_K"])
    parser.add_argument("--shapes", nargs="*", default=["2048x8192", "8192x2048"], help="OUTxIN")
    parser.add_argument("--rows", nargs="*", type=int, default=[1, 8, 64, 512])
    parser.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--cold", action="store_true", help="copies of the weight beyond the last-level cache")
    parser.add_argument("--unpacked", action="store_true", help="also time the rows as the file has them")
    parser.add_argument("--probe", action="store_true", help="first, the read bandwidth of a 512 MiB float32 sum")
    parser.add_argument("--dense", action="store_true", help="also the bf16 copy through a bf16 model's matmul")
    args = parser.parse_args()
    if args.probe:
        for threads in args.threads:
            print(f"read bandwidth, {threads} thread(s): {read_bandwidth(threads):.1f} GB/s")
    from pagedllm.platform.cpu import LEVELS, isa_level

    top = isa_level()
    levels = args.levels or [lv for lv in LEVELS[1:LEVELS.index(top) + 1] if lv != "amx"]
    print(f"{'level':12} {'format':9} {'shape':10} {'rows':>4} {'thr':>3} {'min us':>9} {'median':>9} {'GB/s':>6}")
    for level in levels:
        with cpu_ops.use_level(level):
            kernels = cpu_ops.active()
            assert kernels is not None and (kernels.level == level or level == "amx" and kernels.amx), \
                f"no {level} kernels here"
            for shape in args.shapes:
                n, k = (int(v) for v in shape.split("x"))
                for name in args.formats:
                    raw = random_quant(name, n, k)
                    variants = [("", kernels.qpack(raw))]
                    if args.unpacked and variants[0][1].packed:
                        variants.append(("-rows", raw))
                    for tag, w in variants:
                        nbytes = w.data.numel()
                        copies = max(1, cold_bytes() // nbytes) if args.cold else 1
                        weights = [w] + [QuantTensor(w.qtype, w.rows, w.cols, w.data.clone(), w.packed, w.level)
                                         for _ in range(copies - 1)]
                        label = name + ("p" if w.packed else "") + tag
                        for threads in args.threads:
                            torch.set_num_threads(threads)
                            for rows in args.rows:
                                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                                if args.dense:
                                    x = x.bfloat16()
                                reps = max(5, args.reps if rows <= 8 else args.reps // 3)
                                fastest, median = time_call(kernels, x, weights, reps)
                                print(f"{level:12} {label:9} {shape:10} {rows:4} {threads:3} {fastest * 1e6:9.1f} "
                                      f"{median * 1e6:9.1f} {nbytes / fastest / 1e9:6.1f}", flush=True)
                    if args.dense:
                        time_dense(kernels.qrows(raw, torch.arange(n), torch.bfloat16), args, level)


def time_dense(weight: torch.Tensor, args: argparse.Namespace, level: str) -> None:
    """Rows through a bf16 model's matmul over ``weight`` (its prepack: AMX tiles / oneDNN), as ``main`` prints."""
    from pagedllm.layers import prepack

    n, k = weight.shape
    nbytes = weight.numel() * 2
    copies = max(1, cold_bytes() // nbytes) if args.cold else 1
    packs = [prepack.prepack(weight.clone()) for _ in range(copies)]
    label = "bf16" + ("-amx" if packs[0].amx else "-ours" if packs[0].kernels is not None else "-onednn")
    _time_matmuls([prepack.matmul_for(p, None) for p in packs], label, weight.shape, nbytes, args, level)
    if packs[0].amx:  # and oneDNN's packed layout, for comparison
        packs = [prepack.PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight.clone()), n, None)
                 for _ in range(copies)]
        _time_matmuls([prepack.matmul_for(p, None) for p in packs], "bf16-dnnp", weight.shape, nbytes, args, level)


def _time_matmuls(matmuls: list, label: str, shape: torch.Size, nbytes: int, args: argparse.Namespace,
                  level: str) -> None:
    n, k = shape
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
            reps = max(5, args.reps if rows <= 8 else args.reps // 3)
            for matmul in matmuls[:2]:
                matmul(x)
            times = []
            for i in range(reps):
                start = time.perf_counter()
                matmuls[i % len(matmuls)](x)
                times.append(time.perf_counter() - start)
            fastest = min(times)
            print(f"{level:12} {label:9} {n}x{k:<5} {rows:4} {threads:3} {fastest * 1e6:9.1f} "
                  f"{float(np.median(times)) * 1e6:9.1f} {nbytes / fastest / 1e9:6.1f}", flush=True)


if __name__ == "__main__":
    main()
