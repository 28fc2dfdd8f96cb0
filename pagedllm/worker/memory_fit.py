"""What a model takes in host memory: a KV block's bytes, a loaded model's weight bytes, and what loading it took
(``LoadMeter``: its seconds and the peak RSS it reached, reported at start-up and by ``pagedllm bench``).
"""
from __future__ import annotations

import dataclasses
import time

import torch
from torch import nn

from pagedllm.attention import kv_quant
from pagedllm.models.config import ArchConfig

GIB = 1024**3


def kv_block_bytes(arch: ArchConfig, num_kv_heads: int, block_size: int, kv_dtype: torch.dtype,
                   draft: ArchConfig | None = None) -> int:
    """Bytes of one KV block of one rank holding ``num_kv_heads`` of the model's KV heads (K and V of every
    layer; an int8 cache's scales included), a draft model's layers included (its K/V sit in the same blocks,
    all its heads on every rank)."""
    total = 2 * arch.num_layers * num_kv_heads * kv_quant.head_block_bytes(block_size, arch.head_dim, kv_dtype)
    if draft is not None:
        total += 2 * draft.num_layers * draft.num_kv_heads * kv_quant.head_block_bytes(block_size, draft.head_dim,
                                                                                      kv_dtype)
    return total


# ------------------------------------------------------------------------------------------------ measuring a load

def weight_bytes(model: nn.Module) -> int:
    """Bytes a loaded model's weights take: parameters, buffers, packed copies and rows kept quantized (a tensor
    shared by two modules counted once)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        tensors += [packed.data for name in ("packed_weight", "silu_packed")
                    if (packed := getattr(module, name, None)) is not None]
        if (quant := getattr(module, "quant", None)) is not None:  # rows kept in GGUF formats
            tensors += [piece.data for piece in quant.pieces.values()]
        for t in tensors:
            if t.is_mkldnn:  # oneDNN's opaque packed copy: the same size as the plain tensor
                size, key = t.numel() * t.element_size(), id(t)
            else:
                size, key = t.untyped_storage().nbytes(), t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += size
    return total


def process_memory() -> dict[str, int]:
    """This process's VmRSS and VmHWM (its peak RSS), in bytes (zeros where /proc is not there)."""
    out = {"VmRSS": 0, "VmHWM": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in out:
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """How loading the weights went (a worker's, reported at start-up and by ``pagedllm bench``)."""

    seconds: float
    """From the model's construction to its weights processed (packed, quantized)."""
    weights_bytes: int
    rss_before_bytes: int
    peak_rss_bytes: int
    """The process's peak RSS while loading (its VmHWM, reset when loading starts where Linux allows)."""

    def line(self) -> str:
        return (f"Loaded weights in {self.seconds:.1f} s: {self.weights_bytes / GIB:.2f} GiB of weights, peak RSS "
                f"{self.peak_rss_bytes / GIB:.2f} GiB ({self.rss_before_bytes / GIB:.2f} GiB before loading)")


class LoadMeter:
    """Times a load and reads the peak RSS it reached: ``start()``, then ``report(weights)`` once it is done."""

    def start(self) -> None:
        try:  # "5" resets the peak RSS (VmHWM) to the RSS now: the peak read after is the load's own
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:  # not Linux, or not allowed: the peak read is the process's since it started
            pass
        self.rss_before = process_memory()["VmRSS"]
        self.began = time.perf_counter()

    def report(self, weights: int) -> LoadReport:
        memory = process_memory()
        return LoadReport(seconds=time.perf_counter() - self.began, weights_bytes=weights,
                          rss_before_bytes=self.rss_before, peak_rss_bytes=max(memory["VmHWM"], memory["VmRSS"]))
