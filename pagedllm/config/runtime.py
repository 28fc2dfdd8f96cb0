"""The configs of what runs the model: the KV cache, the scheduler's limits, the parallel layout and the device.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config.values import KV_CACHE_DTYPES
from pagedllm.errors import ValidationError


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory: int | None = None
    """Bytes for the KV pool; None picks a default from free memory."""
    num_kv_blocks: int | None = None
    """Exact number of KV blocks (overrides kv_cache_memory; for tests and experiments)."""
    enable_prefix_caching: bool = True
    """Reuse the K/V of full blocks whose token prefix was seen before."""
    swap_space: float = 4.0
    """GiB of host memory for blocks of requests preempted by swapping."""
    worker_memory_limit: int | None = None
    """Bytes one rank may hold (weights, KV pool, swap space); None: the machine's memory bounds it."""
    gpu_memory_utilization: float = 0.9
    """On a GPU: the share of its memory the engine may use (weights, activations, KV pool)."""
    sliding_window: int | None = None
    """The model's every layer attends to this many last positions only: blocks before a request's window
    go back to the pool (set from the model, not an option)."""
    cache_dtype: str = "auto"
    """K/V storage: "auto" (the model's dtype) or "int8" (per slot and head scales: ~2x the blocks)."""

    def __post_init__(self) -> None:
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ValidationError.bad_value("gpu_memory_utilization", util, "a number in (0, 1]")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValidationError.bad_value("enable_prefix_caching", self.enable_prefix_caching, "true or false")
        if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, (int, float)) or self.swap_space < 0:
            raise ValidationError.bad_value("swap_space", self.swap_space, "a number of GiB >= 0")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValidationError.bad_value("block_size", self.block_size, "a positive integer")
        if self.cache_dtype not in KV_CACHE_DTYPES:
            hint = " (fp8 KV caches are not implemented; int8 halves the bytes on every CPU)" \
                if isinstance(self.cache_dtype, str) and self.cache_dtype.startswith("fp8") else ""
            raise ValidationError.bad_value("kv_cache_dtype", self.cache_dtype,
                                            " or ".join(repr(d) for d in KV_CACHE_DTYPES) + hint)
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2):
            raise ValidationError.bad_value("num_kv_blocks", self.num_kv_blocks,
                                            "an integer >= 2 (block 0 is the null block)")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Iteration-level scheduling limits."""

    max_num_seqs: int = 256
    """Most requests running in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prompt chunks + decode tokens)."""
    max_model_len: int = 8192
    """Most tokens in one sequence (copied from ModelConfig)."""
    preemption_mode: str = "recompute"
    """How a preempted request gives its blocks back: "recompute" (drop the K/V) or "swap" (to host)."""
    max_loras: int | None = None
    """Most distinct LoRA adapters among running requests (None: LoRA off)."""
    max_num_batched_attention: int | None = None
    """Query x key positions one step may attend (a token at position p attends p + 1): a prompt chunk shrinks to
    stay under it, at least one block per step; decode tokens are never held back. None: no such bound."""
    step_time_target: float | None = None
    """Seconds a step that also decodes should take at most: its prompt chunks shrink to fit the estimate (see
    core/step_time.py). None: off."""

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValidationError.bad_value("preemption_mode", self.preemption_mode, "'recompute' or 'swap'")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValidationError.bad_value("max_num_seqs", self.max_num_seqs, "a positive integer")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValidationError.bad_value("max_num_batched_tokens", self.max_num_batched_tokens, "a positive integer")
        attention = self.max_num_batched_attention
        if attention is not None and (isinstance(attention, bool) or not isinstance(attention, int) or attention < 1):
            raise ValidationError.bad_value("max_num_batched_attention", attention, "a positive integer")
        target = self.step_time_target
        if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float))
                                   or not 0 < target < float("inf")):
            raise ValidationError.bad_value("step_time_target", target, "a positive number of seconds or None")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the model is split across ranks, and which executor runs them."""

    tensor_parallel_size: int = 1
    """Ranks that share each layer (Megatron-style: heads and MLP columns split, all-reduce after)."""
    pipeline_parallel_size: int = 1
    """Stages the layers are split into, each a worker (or a tensor-parallel group of them) holding its layers'
    weights and KV cache; hidden states pass from stage to stage."""
    pp_layer_partition: str | None = None
    """Layers per stage, comma separated ("14,16"; vLLM's VLLM_PP_LAYER_PARTITION); None: an even split."""
    batches_in_flight: int | None = None
    """Batches of different requests going through the pipeline stages at once (PAGEDLLM_PP_BATCHES_IN_FLIGHT);
    None: the executor decides (pipeline_parallel_size where every stage has machines of its own, every one at
    work; else 1, the stages one at a time on the cores they share)."""
    distributed_executor_backend: str | None = None
    """"uni" (one worker in the engine's process), "mp" (a worker process per rank on this machine)
    or "ray" (a Ray actor per rank, any number of machines); None: "uni" for one rank, else "mp"."""

    data_parallel_size: int = 1
    """Engine cores (replicas), each with its own KV pool, scheduler and tensor-parallel group, behind one front."""
    data_parallel_backend: str = "mp"
    """"mp" (replicas as processes on this machine, its cores split between them) or "ray" (one placement-group
    bundle per replica, on any node of the cluster)."""
    data_parallel_routing: str = "prefix"
    """"prefix" (to the replica caching the longest prefix of the prompt, within a bound on imbalance),
    "least-loaded" or "round-robin"."""
    data_parallel_restart: bool = False
    """Start a replica again when it dies (the others serve meanwhile)."""
    worker_extension_cls: str = ""
    """"package.module.Class" mixed into every worker (worker/extension.py); "" for none."""

    def __post_init__(self) -> None:
        if not isinstance(self.worker_extension_cls, str) or (self.worker_extension_cls
                                                              and "." not in self.worker_extension_cls):
            raise ValidationError.bad_value("worker_extension_cls", self.worker_extension_cls,
                                            "a class's full name, package.module.Class")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValidationError.bad_value("tensor_parallel_size", tp, "a positive integer")
        pp = self.pipeline_parallel_size
        if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
            raise ValidationError.bad_value("pipeline_parallel_size", pp, "a positive integer")
        if self.pp_layer_partition is not None and (not isinstance(self.pp_layer_partition, str) or pp == 1):
            raise ValidationError.bad_value("pp_layer_partition", self.pp_layer_partition,
                                            "layer counts per stage, with pipeline_parallel_size > 1")
        depth = self.batches_in_flight
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1 or pp == 1):
            raise ValidationError.bad_value("batches_in_flight", depth,
                                            "None, or a positive integer with pipeline_parallel_size > 1")
        dp = self.data_parallel_size
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
            raise ValidationError.bad_value("data_parallel_size", dp, "a positive integer")
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ValidationError.bad_value("data_parallel_backend", self.data_parallel_backend, "'mp' or 'ray'")
        if self.data_parallel_routing not in ("prefix", "least-loaded", "round-robin"):
            raise ValidationError.bad_value("data_parallel_routing", self.data_parallel_routing,
                                            "'prefix', 'least-loaded' or 'round-robin'")
        if not isinstance(self.data_parallel_restart, bool):
            raise ValidationError.bad_value("data_parallel_restart", self.data_parallel_restart, "true or false")
        backend = self.distributed_executor_backend
        if backend is None:
            object.__setattr__(self, "distributed_executor_backend", "uni" if self.world_size == 1 else "mp")
        elif backend not in ("uni", "mp", "ray"):
            raise ValidationError.bad_value("distributed_executor_backend", backend, "'uni', 'mp' or 'ray'")
        elif backend == "uni" and self.world_size > 1:
            raise ValidationError.bad_value("distributed_executor_backend", backend, "'mp' or 'ray' with "
                                            "tensor_parallel_size or pipeline_parallel_size > 1 (uni runs one rank)")

    @property
    def world_size(self) -> int:
        """Workers of one engine: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def answering_rank(self) -> int:
        """The worker whose step results the scheduler takes: the last pipeline stage's first rank (it samples)."""
        return self.world_size - self.tensor_parallel_size


@dataclass(frozen=True, kw_only=True)
class DeviceConfig:
    """Where the model runs."""

    device: str = "cpu"
    """"cpu" or "cuda" (resolved from EngineArgs.device "auto")."""
    attention_backend: str = "auto"
    """"torch" (reference), "cpu" (compiled CPU kernels), "triton" (Triton kernels: CUDA, or CPU under
    TRITON_INTERPRET=1) or "auto" (on a CPU: cpu where it builds, else torch; on CUDA: triton)."""
    enforce_eager: bool = False
    """Never capture CUDA graphs (a CPU always runs eagerly)."""
    cuda_graph_sizes: tuple[int, ...] = ()
    """Decode batch sizes captured as CUDA graphs, ascending (resolved by parse_cuda_graph_sizes)."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValidationError.bad_value("device", self.device, "'auto', 'cpu' or 'cuda'")
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise ValidationError.bad_value("attention_backend", self.attention_backend,
                                            "'auto', 'torch', 'cpu' or 'triton'")
        if not isinstance(self.enforce_eager, bool):
            raise ValidationError.bad_value("enforce_eager", self.enforce_eager, "true or false")


#: Largest decode batch the default CUDA-graph ladder captures (vLLM's default stops at 512).
MAX_DEFAULT_GRAPH_SIZE = 256


def parse_cuda_graph_sizes(sizes: str | list[int] | tuple[int, ...] | None, max_num_seqs: int) -> tuple[int, ...]:
    """The decode batch sizes to capture, ascending: ``sizes`` ("1,2,4,8" or a list) or, when None,
    1, 2, 4, then every multiple of 8, up to min(max_num_seqs, 256), plus max_num_seqs itself below that."""
    if sizes is None:
        top = min(max_num_seqs, MAX_DEFAULT_GRAPH_SIZE)
        ladder = {s for s in (1, 2, 4, *range(8, top + 1, 8)) if s <= top} | {top}
        return tuple(sorted(ladder))
    error = ValidationError.bad_value("cuda_graph_sizes", sizes,
                                      f"batch sizes in [1, max_num_seqs={max_num_seqs}], e.g. '1,2,4,8'")
    items = sizes.split(",") if isinstance(sizes, str) else sizes
    if not isinstance(items, (list, tuple)) or not items:
        raise error
    parsed = []
    for item in items:
        if isinstance(item, str) and item.strip().isdigit():
            item = int(item)
        if isinstance(item, bool) or not isinstance(item, int) or not 1 <= item <= max_num_seqs:
            raise error
        parsed.append(item)
    return tuple(sorted(set(parsed)))
