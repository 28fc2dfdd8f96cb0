"""A back-of-the-envelope model of tensor-parallel decode for a 13B Llama on 1, 2, 4 and 8 GPUs.

Per decode step of B sequences, each of N GPUs reads its 1/N of the weights, does 1/N of the
FLOPs, and takes part in two all-reduces per layer (after o_proj and down_proj) of B x hidden
bf16 values, plus one for the embedding: a ring all-reduce sends 2(N-1)/N of the buffer per GPU
and pays a fixed latency per call. Nothing is overlapped (as in pagedllm's layers today).

    python benchmarks/tp_scaling_model.py
"""
from __future__ import annotations

from dataclasses import dataclass

# Llama-2-13B
HIDDEN, LAYERS, PARAMS, BYTES = 5120, 40, 13.0e9, 2  # bf16
ALL_REDUCES = 2 * LAYERS + 1


@dataclass(frozen=True)
class Gpu:
    name: str
    hbm: float  # bytes/s
    flops: float  # dense bf16 FLOP/s


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes/s per direction per GPU
    latency: float  # s per small all-reduce


H200 = Gpu("H200", 4.8e12, 989e12)
LINKS = [Link("NVLink 4 (450 GB/s)", 450e9, 10e-6), Link("PCIe 5 x16 (~50 GB/s)", 50e9, 25e-6)]


def step_time(n: int, batch: int, gpu: Gpu, link: Link) -> tuple[float, float, float]:
    """(compute-or-memory time, all-reduce time, bytes each GPU sends) of one decode step."""
    weights = PARAMS * BYTES / n / gpu.hbm
    compute = 2 * PARAMS * batch / n / gpu.flops
    buffer = batch * HIDDEN * BYTES
    sent = ALL_REDUCES * buffer * 2 * (n - 1) / n
    comm = 0.0 if n == 1 else ALL_REDUCES * link.latency + sent / link.bandwidth
    return max(weights, compute), comm, sent


def main() -> None:
    print(f"Llama-2-13B (bf16, {PARAMS * BYTES / 1e9:.0f} GB of weights) on {H200.name}s; all-reduce bytes per token "
          f"per GPU = {ALL_REDUCES} x {HIDDEN} x {BYTES} B x 2(N-1)/N")
    for link in LINKS:
        print(f"\n{link.name}, {link.latency * 1e6:.0f} us per all-reduce")
        print("| GPUs | batch | weights/FLOPs ms | all-reduce ms | step ms | tokens/s | speed-up vs 1 GPU "
              "| MB sent per GPU |")
        print("|---|---|---|---|---|---|---|---|")
        for batch in (1, 256):
            base = sum(step_time(1, batch, H200, link)[:2])
            for n in (1, 2, 4, 8):
                work, comm, sent = step_time(n, batch, H200, link)
                step = work + comm
                print(f"| {n} | {batch} | {work * 1e3:.2f} | {comm * 1e3:.2f} | {step * 1e3:.2f} | "
                      f"{batch / step:,.0f} | {base / step:.2f}x | {sent / 1e6:.1f} |")


if __name__ == "__main__":
    main()
