"""A worker: one device's model shard, KV cache tensors and model runner."""
from __future__ import annotations

import logging

import torch
from tqdm.auto import tqdm

from pagedllm import platform
from pagedllm.attention.base import get_attention_backend, resolve_backend_name
from pagedllm.config import EngineConfig, available_memory_bytes
from pagedllm.errors import ValidationError
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.models.config import ArchConfig
from pagedllm.models.loader import iter_weights
from pagedllm.models.registry import get_model_class
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

#: Default KV pool when neither kv_cache_memory nor num_kv_blocks is given: this share of
#: free memory, at most DEFAULT_KV_CAP (vLLM's CPU default is 4 GiB as well).
DEFAULT_KV_FRACTION = 0.4
DEFAULT_KV_CAP = 4 * 1024**3


class Worker:
    """Loads the model, sizes and allocates the KV pool, runs steps."""

    def __init__(self, config: EngineConfig, arch: ArchConfig, eos_token_ids: tuple[int, ...]) -> None:
        self.config = config
        self.arch = arch
        self.dtype = getattr(torch, config.model.dtype)
        # the kernels are built (or read from the cache) here, before any request can arrive
        backend = get_attention_backend(resolve_backend_name(config.device.attention_backend))
        logger.info("%s; attention backend %s", platform.describe(config.model.dtype), backend.name)
        model = get_model_class(arch)(arch, self.dtype, config.model.max_model_len)
        model.load_weights(tqdm(iter_weights(config.model.model, arch), desc="Loading weights", unit=" tensors",
                                leave=False, dynamic_ncols=True))
        for module in model.modules():  # once the checkpoint is in: e.g. weights packed for the CPU GEMM
            if hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
        model.eval()
        self.model_runner = ModelRunner(model, backend, config.cache.block_size,
                                        config.model.seed, eos_token_ids)

    def kv_block_bytes(self) -> int:
        """Bytes of one block across all layers (K and V)."""
        a, bs = self.arch, self.config.cache.block_size
        return 2 * a.num_layers * bs * a.num_kv_heads * a.head_dim * self.dtype.itemsize

    def determine_num_kv_blocks(self) -> int:
        """num_kv_blocks if given, else kv_cache_memory (or the default) / bytes per block."""
        cache, sched = self.config.cache, self.config.scheduler
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        budget = cache.kv_cache_memory
        if budget is None:
            budget = min(DEFAULT_KV_CAP, int(available_memory_bytes() * DEFAULT_KV_FRACTION))
            # never more than every running sequence at full length could use
            most = (sched.max_num_seqs * -(-sched.max_model_len // cache.block_size) + 1) * self.kv_block_bytes()
            budget = min(budget, most)
        num_blocks = budget // self.kv_block_bytes()
        if num_blocks < 2:
            raise ValidationError.bad_value("kv_cache_memory", budget,
                                            f"at least 2 KV blocks ({2 * self.kv_block_bytes()} bytes)")
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, cache.block_size,
                    num_blocks * self.kv_block_bytes() / 1024**3)
        return num_blocks

    def determine_num_host_blocks(self) -> int:
        """Blocks of host memory for swapped-out requests (swap_space GiB), when swapping is on."""
        if self.config.scheduler.preemption_mode != "swap":
            return 0
        return int(self.config.cache.swap_space * 1024**3) // self.kv_block_bytes()

    def initialize_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        self.model_runner.initialize_kv_cache(num_blocks, self.dtype, num_host_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

