"""Configuration: one frozen dataclass per subsystem, and EngineConfig, which holds them all.

Each component receives only its own config. Facts found at start-up (the number of KV blocks, EOS ids) live in
runtime objects, never in these. The user-facing options and their resolution into these configs (against the
model's files and the machine) are EngineArgs' (engine/arg_utils.py, as vLLM's ``vllm.engine.arg_utils``):

    values.py    memory sizes, JSON options, the machine's free memory, the default KV pool
    model.py     ModelConfig, PoolerConfig
    runtime.py   CacheConfig, SchedulerConfig, ParallelConfig, DeviceConfig
    features.py  LoRAConfig, SpeculativeConfig, StructuredOutputsConfig, WatermarkConfig
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config.features import (
    DEFAULT_GRAMMAR_CACHE_BYTES,
    MAX_SPEC_TOKENS,
    SPEC_METHODS,
    WATERMARK_SCOPES,
    LoRAConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    WatermarkConfig,
)
from pagedllm.config.model import CHUNKED_POOLING_TYPES, DEFAULT_MAX_LOGPROBS, POOLING_TYPES, ModelConfig, PoolerConfig
from pagedllm.config.runtime import (
    MAX_DEFAULT_GRAPH_SIZE,
    CacheConfig,
    DeviceConfig,
    ParallelConfig,
    SchedulerConfig,
    parse_cuda_graph_sizes,
)
from pagedllm.config.values import (
    DEFAULT_KV_CAP,
    DEFAULT_KV_FRACTION,
    DEFAULT_MODEL_NAME,
    KV_CACHE_DTYPES,
    available_memory_bytes,
    cgroup_available_bytes,
    default_kv_budget,
    json_object,
    parse_memory,
)

__all__ = [
    'CHUNKED_POOLING_TYPES', 'CacheConfig', 'DEFAULT_GRAMMAR_CACHE_BYTES', 'DEFAULT_KV_CAP', 'DEFAULT_KV_FRACTION',
    'DEFAULT_MAX_LOGPROBS', 'DEFAULT_MODEL_NAME', 'DeviceConfig', 'EngineConfig', 'KV_CACHE_DTYPES', 'LoRAConfig',
    'MAX_DEFAULT_GRAPH_SIZE', 'MAX_SPEC_TOKENS', 'ModelConfig', 'POOLING_TYPES', 'ParallelConfig', 'PoolerConfig',
    'SPEC_METHODS', 'SchedulerConfig', 'SpeculativeConfig', 'StructuredOutputsConfig', 'WATERMARK_SCOPES',
    'WatermarkConfig', 'available_memory_bytes', 'cgroup_available_bytes', 'default_kv_budget', 'json_object',
    'parse_cuda_graph_sizes', 'parse_memory',
]


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """All subsystem configs of one engine."""

    model: ModelConfig
    """The model, its dtype and length limit."""
    cache: CacheConfig
    """The KV block pool."""
    scheduler: SchedulerConfig
    """Per-step limits."""
    parallel: ParallelConfig
    """Tensor parallelism."""
    device: DeviceConfig
    """The device."""
    lora: LoRAConfig | None = None
    """LoRA adapters (None: enable_lora is off)."""
    structured_outputs: StructuredOutputsConfig = StructuredOutputsConfig()
    """The grammar compiler's cache."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding (None: off)."""
    watermark: WatermarkConfig | None = None
    """Text watermarking (None: off)."""
