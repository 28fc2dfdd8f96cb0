"""pagedllm: a high-throughput, memory-efficient LLM inference engine built on PagedAttention.

The public names are imported lazily, so ``import pagedllm.core`` does not load torch.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "LLM": "pagedllm.entrypoints.llm",
    "SamplingParams": "pagedllm.sampling_params",
    "BeamSearchParams": "pagedllm.sampling_params",
    "BeamSearchOutput": "pagedllm.outputs",
    "RequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
    "Logprob": "pagedllm.outputs",
    "ValidationError": "pagedllm.errors",
    "EngineArgs": "pagedllm.config",
    "LLMEngine": "pagedllm.engine.llm_engine",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
