"""What a model takes in host memory, known before it is loaded, and what loading it took.

``check_fits`` refuses (a ValidationError with the figures) an engine whose weights and KV cache cannot fit the
memory this machine (or its cgroup) still has, before anything is allocated: without it an 8B model on a small
machine was killed by the OOM killer minutes into loading. The weights' bytes come from the model built on the
meta device (every parameter and buffer at its shape and dtype, no memory), adjusted for what loading makes of
them: a GGUF file's kept matrices at the file's sizes, int8 rows, the packed copy of a tied LM head.
"""
from __future__ import annotations

import dataclasses
import time

import torch
from torch import nn

from pagedllm import platform
from pagedllm.attention import kv_quant
from pagedllm.config import DEFAULT_KV_CAP, CacheConfig, EngineConfig, available_memory_bytes, cgroup_available_bytes
from pagedllm.distributed.parallel_state import shard_heads
from pagedllm.errors import ValidationError
from pagedllm.layers import cpu_ops
from pagedllm.layers.quant import GGML_TYPES, wants_dense
from pagedllm.models.config import ArchConfig
from pagedllm.models.registry import get_model_class

GIB = 1024**3


def kv_block_bytes(arch: ArchConfig, num_kv_heads: int, block_size: int, kv_dtype: torch.dtype,
                   draft: ArchConfig | None = None, num_layers: int | None = None) -> int:
    """Bytes of one KV block of one rank holding ``num_kv_heads`` of the model's KV heads (K and V of every
    layer, or of ``num_layers``: a pipeline stage's; an int8 cache's scales included), a draft model's layers
    included (its K/V sit in the same blocks, all its heads on every rank)."""
    layers = arch.num_layers if num_layers is None else num_layers
    total = 2 * layers * num_kv_heads * kv_quant.head_block_bytes(block_size, arch.head_dim, kv_dtype)
    if draft is not None:
        total += 2 * draft.num_layers * draft.num_kv_heads * kv_quant.head_block_bytes(block_size, draft.head_dim,
                                                                                      kv_dtype)
    return total


@dataclasses.dataclass(frozen=True)
class WeightBytes:
    """A model's weights in host memory, all ranks together."""

    loading: int
    """The most they take while loading (quantization="int8": the float weights, before they become rows)."""
    final: int
    """What they take once processed (packed copies included)."""


def estimate_weight_bytes(path: str, arch: ArchConfig, config: EngineConfig) -> WeightBytes:
    """The weights of the model at ``path`` as ``config`` loads them, from its shapes alone (no tensor is read)."""
    dtype = getattr(torch, config.model.dtype)
    with torch.device("meta"):  # shapes and dtypes only: nothing is allocated
        model = get_model_class(arch)(arch, dtype, config.model.max_model_len)
    quantization = config.model.quantization
    kept_elements, kept_bytes, embedding_kept = 0, 0, False
    kernels = cpu_ops.kernels_for(config.device.device)  # what the layers will bind (None: not the CPU, or off)
    if quantization == "gguf" and path.endswith(".gguf") and kernels is not None:  # else dequantized at load
        from pagedllm.models.loader.gguf_loader import kept_tensors

        for name, qtype, rows, cols, _nbytes in kept_tensors(path, arch):
            kept_elements += rows * cols
            kept_bytes += kernels.qpacked_bytes(qtype, rows, cols)  # the kernels' copy (Q8_0: f32 scales, +6%)
            embedding_kept |= name == "token_embd.weight"
    loading = sum(t.numel() * t.element_size() for t in _unique_tensors(model))
    loading += kept_bytes - kept_elements * dtype.itemsize
    final = loading
    room = dense_copy_room(config, config.parallel.tensor_parallel_size) - loading  # (the weights are not in yet)
    if kept_elements and wants_dense(kernels.amx, dtype, quantization, kept_elements * dtype.itemsize, room):
        final += kept_elements * dtype.itemsize  # their dense copies (layers/quant.py add_dense_copies)
    if quantization == "int8" and kernels is not None:
        for weight in _unique_tensors(model):
            if isinstance(weight, nn.Parameter) and _becomes_int8(weight):  # its float copy becomes Q8_0 rows
                rows, cols = weight.shape
                final += kernels.qpacked_bytes(GGML_TYPES["Q8_0"], rows, cols) - weight.numel() * weight.element_size()
    for module in model.modules():
        if getattr(module, "tied", False) and platform.is_cpu(config.device.device) and not embedding_kept \
                and not (quantization == "int8" and kernels is not None):  # (else the head shares the table's rows)
            if not (dtype == torch.bfloat16 and _plain_on_amx(module.weight)):  # AMX reads it plain
                final += module.weight.numel() * module.weight.element_size()  # the LM head's packed copy
    return WeightBytes(loading, final)


def _unique_tensors(model: nn.Module) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen.setdefault(id(t), t)
    return list(seen.values())


def _becomes_int8(weight: nn.Parameter) -> bool:
    """quantization="int8" turns this float weight into rows (layers/quant.py ``will_quantize``, shapes only)."""
    return getattr(weight, "takes_quantized", False) and weight.dim() == 2 and weight.shape[1] % 32 == 0


def dense_copy_room(config: EngineConfig, ranks: int) -> int:
    """The bytes one of ``ranks`` ranks on this machine has for dense copies of weights kept quantized (layers/quant.py
    ``wants_dense`` takes a share of it): what the OS can still give, less every rank's KV pool (kv_cache_memory,
    else the default pool's cap, DEFAULT_KV_CAP), shared between the ranks."""
    kv = config.cache.kv_cache_memory if config.cache.kv_cache_memory is not None else DEFAULT_KV_CAP
    return max(0, (available_memory_bytes() - kv * ranks) // max(1, ranks))


def _pool_bytes(cache: CacheConfig, blocks: list[int], tp: int) -> tuple[int, str]:
    """The device KV pools' bytes over the ranks (``blocks``: each rank's bytes per block), and how they were asked."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks * sum(blocks), f"num_kv_blocks={cache.num_kv_blocks}"
    if cache.kv_cache_memory is not None:
        # each rank's blocks of its budget (worker.determine_num_kv_blocks)
        kv = sum(cache.kv_cache_memory // b * b for b in blocks)
        return kv, f"kv_cache_memory={cache.kv_cache_memory / GIB:.2f} GiB" + (f" x {tp} ranks" if tp > 1 else "")
    return 2 * sum(blocks), "at least 2 blocks; by default a share of what the weights leave"


def requested_kv_bytes(config: EngineConfig, arch: ArchConfig, draft: ArchConfig | None) -> tuple[int, str]:
    """Bytes of KV cache (and host swap space) every rank together asks for, and how it was asked: num_kv_blocks,
    kv_cache_memory, or by default the least the worker accepts (2 blocks: its default pool is a share of what
    is free once the weights are in, so it always fits; config.py ``default_kv_budget``)."""
    cache, tp = config.cache, config.parallel.tensor_parallel_size
    if config.model.encoder_only:  # bidirectional attention over whole inputs: nothing is cached
        return 0, "no KV cache"
    kv_dtype = kv_quant.kv_cache_torch_dtype(cache.cache_dtype, getattr(torch, config.model.dtype))
    blocks = [kv_block_bytes(arch, shard_heads(arch.num_heads, arch.num_kv_heads, tp, rank).num_kv_heads,
                             cache.block_size, kv_dtype, draft) for rank in range(tp)]
    kv, how = _pool_bytes(cache, blocks, tp)
    if config.scheduler.preemption_mode == "swap":
        kv += sum(int(cache.swap_space * GIB) // b * b for b in blocks)
        how += f", swap_space={cache.swap_space} GiB" + (f" x {tp} ranks" if tp > 1 else "")
    return kv, how


def check_fits(config: EngineConfig, arch: ArchConfig) -> None:
    """Refuse, before anything is allocated, weights + KV cache that cannot fit the memory available here.

    Checked on a CPU whose ranks all run on this machine (one process, or one per rank): a GPU holds both in its
    own memory (sized there by a profiling step), and Ray may place ranks on other machines."""
    if not platform.is_cpu(config.device.device) or config.parallel.distributed_executor_backend not in ("uni", "mp"):
        return
    spec = config.speculative
    draft = None
    weights = estimate_weight_bytes(config.model.model, arch, config)
    if spec is not None and spec.uses_draft_model:
        from pagedllm.models.loader import load_arch_config

        draft = load_arch_config(spec.model)
        extra = estimate_weight_bytes(spec.model, draft, config)
        weights = WeightBytes(weights.loading + extra.loading, weights.final + extra.final)
    kv, how = requested_kv_bytes(config, arch, draft)
    available = available_memory_bytes()
    need = max(weights.loading, weights.final + kv)
    if need <= available:
        return
    cgroup = cgroup_available_bytes()
    where = "MemAvailable" if cgroup is None or cgroup > available else "the memory cgroup's limit"
    loading = f" ({weights.loading / GIB:.2f} GiB while loading)" if weights.loading > weights.final else ""
    param, value = (("num_kv_blocks", config.cache.num_kv_blocks) if config.cache.num_kv_blocks is not None else
                    ("kv_cache_memory", config.cache.kv_cache_memory) if config.cache.kv_cache_memory is not None
                    else ("model", config.model.model))
    raise ValidationError(
        f"the model does not fit in memory: {weights.final / GIB:.2f} GiB for the weights{loading} "
        f"({config.model.dtype}{', ' + config.model.quantization if config.model.quantization else ''}) + "
        f"{kv / GIB:.2f} GiB for the KV cache ({how}) = {need / GIB:.2f} GiB needed, "
        f"{available / GIB:.2f} GiB available ({where}). Ask for a smaller KV cache (kv_cache_memory, "
        "num_kv_blocks), or load a smaller model, dtype or quantized GGUF file", param=param, value=value)


def _plain_on_amx(weight: torch.Tensor) -> bool:
    """The weight would stay plain for the AMX GEMM at the "amx" level (layers/prepack.py): no packed copy."""
    from pagedllm.layers.prepack import amx_takes

    return platform.bf16_gemm() == "amx" and amx_takes(*weight.shape)


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
        if (quant := getattr(module, "quant", None)) is not None:  # rows kept in GGUF formats, a dense copy
            tensors += [piece.data for piece in quant.pieces.values()] + ([] if quant.dense is None else [quant.dense])
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
