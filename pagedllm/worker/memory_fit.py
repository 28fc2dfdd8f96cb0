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
from pagedllm.config import DEFAULT_KV_CAP, EngineConfig, available_memory_bytes, cgroup_available_bytes
from pagedllm.errors import ValidationError
from pagedllm.layers import cpu_ops
from pagedllm.layers.quant import GGML_TYPES, wants_dense
from pagedllm.models.config import ArchConfig
from pagedllm.models.registry import get_model_class, supported_models
from pagedllm.worker.memory_plan import RankBytes, WeightBytes, check_ranks, machine_need, rank_bytes

GIB = 1024**3


def estimate_weight_bytes(path: str, arch: ArchConfig, config: EngineConfig,
                          model: nn.Module | None = None) -> WeightBytes:
    """The weights of the model at ``path`` as ``config`` loads them, from its shapes alone (no tensor is read;
    ``model``: it built on the meta device already)."""
    dtype = getattr(torch, config.model.dtype)
    model = meta_model(config, arch) if model is None else model
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
    head_copy = 0
    for module in model.modules():
        if getattr(module, "tied", False) and platform.is_cpu(config.device.device) and not embedding_kept \
                and not (quantization == "int8" and kernels is not None):  # (else the head shares the table's rows)
            if not (dtype == torch.bfloat16 and _plain_on_amx(module.weight)):  # AMX reads it plain
                head_copy += module.weight.numel() * module.weight.element_size()  # the LM head's packed copy
    return WeightBytes(loading, final + head_copy, head_copy)


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


def requested_kv_bytes(config: EngineConfig, arch: ArchConfig, draft: ArchConfig | None) -> tuple[int, str]:
    """Bytes of KV cache (and host swap space) every rank together asks for, and how it was asked: num_kv_blocks,
    kv_cache_memory, or by default the least the worker accepts (2 blocks: its default pool is a share of what
    is free once the weights are in, so it always fits; config.py ``default_kv_budget``)."""
    return sum(r.kv for r in rank_bytes(config, arch, meta_model(config, arch), WeightBytes(0, 0), draft)), \
        _how_kv(config)


def _how_kv(config: EngineConfig) -> str:
    """How the KV pools were asked for, in words."""
    cache, ranks = config.cache, config.parallel.world_size
    if config.model.encoder_only:  # bidirectional attention over whole inputs: nothing is cached
        return "no KV cache"
    each = f" x {ranks} ranks" if ranks > 1 else ""
    how = (f"num_kv_blocks={cache.num_kv_blocks}" if cache.num_kv_blocks is not None else
           f"kv_cache_memory={cache.kv_cache_memory / GIB:.2f} GiB{each}" if cache.kv_cache_memory is not None else
           "at least 2 blocks; by default a share of what the weights leave")
    if config.scheduler.preemption_mode == "swap":
        how += f", swap_space={cache.swap_space} GiB{each}"
    return how


def meta_model(config: EngineConfig, arch: ArchConfig) -> nn.Module:
    """The model built on the meta device (every tensor at its shape and dtype, no memory), whole (tp=1, pp=1)."""
    with torch.device("meta"):  # shapes and dtypes only: nothing is allocated
        return get_model_class(arch)(arch, getattr(torch, config.model.dtype), config.model.max_model_len)


def plan_ranks(config: EngineConfig, arch: ArchConfig, model: nn.Module | None = None) -> list[RankBytes]:
    """Every rank's weights and KV pool (memory_plan.py), from the config and the checkpoint's shapes alone
    (``model``: ``meta_model``'s, made already)."""
    model = meta_model(config, arch) if model is None else model
    weights = estimate_weight_bytes(config.model.model, arch, config, model)
    spec, draft, extra = config.speculative, None, None
    if spec is not None and spec.uses_draft_model:
        from pagedllm.models.loader import load_arch_config

        draft = load_arch_config(spec.model)
        extra = estimate_weight_bytes(spec.model, draft, config)
    return rank_bytes(config, arch, model, weights, draft, extra)


def check_fits(config: EngineConfig, arch: ArchConfig) -> None:
    """Refuse, before anything is allocated, a rank whose weights + KV cache are over worker_memory_limit, or
    ranks on this machine that together cannot fit the memory available here.

    On a CPU: a GPU holds both in its own memory (sized there by a profiling step); the machine's check is for
    ranks that all run here (one process, or one per rank): the Ray executor checks each node's once its actors
    are placed (``check_machine``)."""
    if not platform.is_cpu(config.device.device):
        return
    model = meta_model(config, arch)
    ranks = plan_ranks(config, arch, model)
    limit = config.cache.worker_memory_limit
    if limit is not None and max(r.need for r in ranks) > limit:
        check_ranks(config, ranks, limit, _fewest_stages(config, arch, model))
    if config.parallel.distributed_executor_backend in ("uni", "mp"):
        check_machine(config, ranks, available_memory_bytes(), "")


def _fewest_stages(config: EngineConfig, arch: ArchConfig, model: nn.Module) -> int | None:
    """The fewest pipeline stages whose ranks all fit worker_memory_limit (0: none do), for a model that runs
    in stages; None where stages are not the answer (it does not run in them, or they are asked already) or not
    known (a GGUF file kept quantized: its stages' shares are the float tensors' proportions, and the first stage
    of SmolLM2-135M Q4_1 at pp=3 loaded 56.1 MB against 48.0 planned)."""
    parallel, limit = config.parallel, config.cache.worker_memory_limit
    entry = supported_models().get(arch.architecture)
    if not getattr(entry, "pipeline_parallel", False) or config.speculative is not None or \
            config.model.pooler is not None or parallel.pipeline_parallel_size > 1 or limit is None or \
            config.model.quantization == "gguf":
        return None
    weights = estimate_weight_bytes(config.model.model, arch, config, model)  # (the same at every split)
    backend = "mp" if parallel.distributed_executor_backend == "uni" else parallel.distributed_executor_backend
    for pp in range(2, arch.num_layers + 1):
        staged = dataclasses.replace(config, parallel=dataclasses.replace(
            parallel, pipeline_parallel_size=pp, distributed_executor_backend=backend))
        if max(r.need for r in rank_bytes(staged, arch, model, weights)) <= limit:
            return pp
    return 0


def check_machine(config: EngineConfig, ranks: list[RankBytes], available: int, where: str) -> None:
    """Refuse ``ranks`` (those on one machine: ``where`` names it, "" this one) that cannot fit ``available``
    bytes together, naming the figures."""
    loading, weights, kv, need = machine_need(ranks)
    if need <= available:
        return
    if where:
        place = where
    else:
        cgroup = cgroup_available_bytes()
        place = "MemAvailable" if cgroup is None or cgroup > available else "the memory cgroup's limit"
    while_loading = f" ({loading / GIB:.2f} GiB while loading)" if loading > weights else ""
    param, value = (("num_kv_blocks", config.cache.num_kv_blocks) if config.cache.num_kv_blocks is not None else
                    ("kv_cache_memory", config.cache.kv_cache_memory) if config.cache.kv_cache_memory is not None
                    else ("model", config.model.model))
    ranks_here = f" ({len(ranks)} ranks)" if len(ranks) > 1 else ""
    raise ValidationError(
        f"the model does not fit in memory: {weights / GIB:.2f} GiB for the weights{while_loading}{ranks_here} "
        f"({config.model.dtype}{', ' + config.model.quantization if config.model.quantization else ''}) + "
        f"{kv / GIB:.2f} GiB for the KV cache ({_how_kv(config)}) = {need / GIB:.2f} GiB needed, "
        f"{available / GIB:.2f} GiB available ({place}). Ask for a smaller KV cache (kv_cache_memory, "
        "num_kv_blocks), split the model over machines (pipeline_parallel_size with the ray executor), or load a "
        "smaller model, dtype or quantized GGUF file", param=param, value=value)


def check_nodes(config: EngineConfig, arch: ArchConfig, nodes: list[tuple[str, int]]) -> None:
    """Refuse ranks placed on machines (``nodes``: each rank's node's name and the memory it has available,
    in rank order) where those on one node cannot fit it together, before any of them loads (the Ray executor's
    check; check_fits makes the uni and mp executors')."""
    if not platform.is_cpu(config.device.device):
        return
    ranks = plan_ranks(config, arch)
    for name in dict.fromkeys(node for node, _ in nodes):
        here = [r for r, (node, _) in zip(ranks, nodes) if node == name]
        available = min(free for node, free in nodes if node == name)
        check_machine(config, here, available, f"MemAvailable of node {name}")


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
