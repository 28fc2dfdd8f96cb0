"""pagedllm: a high-throughput, memory-efficient LLM inference engine built on PagedAttention.

The public names are imported lazily, so ``import pagedllm.core`` does not load torch. A level
forced with ``PAGEDLLM_ISA`` also caps torch's own CPU kernels (ATen, oneDNN, MKL) when pagedllm
is imported before torch, so that the whole process behaves as on a CPU of that level.
"""
from __future__ import annotations

import importlib
import sys
from typing import Any

__version__ = "0.1.0"

if "torch" not in sys.modules:  # PAGEDLLM_ISA=avx2 also caps torch's own kernels, while it still can
    from pagedllm.platform.cpu import cap_torch_to_forced_level

    cap_torch_to_forced_level()

_PUBLIC = {
    "LLM": "pagedllm.entrypoints.llm",
    "SamplingParams": "pagedllm.sampling_params",
    "BeamSearchParams": "pagedllm.sampling_params",
    "StructuredOutputsParams": "pagedllm.sampling_params",
    "BeamSearchOutput": "pagedllm.outputs",
    "RequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
    "Logprob": "pagedllm.outputs",
    "ValidationError": "pagedllm.errors",
    "EngineArgs": "pagedllm.engine.arg_utils",
    "LLMEngine": "pagedllm.engine.llm_engine",
    "LoRARequest": "pagedllm.lora_request",
    "PoolingParams": "pagedllm.pooling_params",
    "PoolingRequestOutput": "pagedllm.outputs",
    "EmbeddingRequestOutput": "pagedllm.outputs",
    "ClassificationRequestOutput": "pagedllm.outputs",
    "ScoringRequestOutput": "pagedllm.outputs",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
