"""The records that cross the project's internal seams (scheduler -> worker, worker -> scheduler, scheduler ->
engine, engine front <-> core, model runner -> attention backends and sampler) are keyword-only dataclasses:
a field added or moved cannot shift the others, and every construction names what it passes.

The user-facing records of outputs.py (Logprob, CompletionOutput, RequestOutput, RequestMetrics, BeamSearch*)
keep vLLM's positional constructors and are not listed here.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect

import pytest

SEAMS: dict[str, list[str]] = {
    "pagedllm.core.scheduler_output": ["NewRequestData", "ForkedRequestData", "CachedRequestData", "SchedulerOutput"],
    "pagedllm.core.scheduler": ["SchedulerStats"],
    "pagedllm.outputs": ["ModelRunnerOutput", "EngineCoreOutput", "TokenLogprobs"],
    "pagedllm.attention.base": ["StepInputs", "BackendEntry"],
    "pagedllm.attention.context": ["ForwardContext"],
    "pagedllm.attention.torch_backend": ["PrefillChunk", "TorchAttentionMetadata"],
    "pagedllm.attention.cpu_backend": ["CpuAttentionMetadata"],
    "pagedllm.attention.triton_backend": ["TritonAttentionMetadata"],
    "pagedllm.worker.worker": ["RankInfo"],
    "pagedllm.worker.input_batch": ["CachedRequestState"],
    "pagedllm.layers.sampler": ["SamplingMetadata", "SamplerOutput"],
    "pagedllm.lora.layers": ["LoRAStep"],
    "pagedllm.config": ["ModelConfig", "CacheConfig", "SchedulerConfig", "ParallelConfig", "DeviceConfig",
                        "LoRAConfig", "StructuredOutputsConfig", "EngineConfig"],
    "pagedllm.engine.arg_utils": ["EngineArgs"],
}
"""Module -> its seam dataclasses."""

MESSAGES = "pagedllm.engine.messages"
"""Every dataclass of this module (front <-> core messages) is a seam record too."""


def _assert_keyword_only(cls: type) -> None:
    assert dataclasses.is_dataclass(cls), f"{cls.__qualname__} is not a dataclass"
    positional = [f.name for f in dataclasses.fields(cls) if not f.kw_only]
    assert not positional, f"{cls.__module__}.{cls.__qualname__}: fields {positional} are not keyword-only"
    # the generated __init__ too (a field declared after a `_: KW_ONLY` marker, a base class's fields)
    params = [p.name for p in inspect.signature(cls).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert not params, f"{cls.__module__}.{cls.__qualname__}(...) takes {params} positionally"


@pytest.mark.parametrize("module,name", [(m, n) for m, names in SEAMS.items() for n in names])
def test_seam_dataclass_is_keyword_only(module: str, name: str) -> None:
    _assert_keyword_only(getattr(importlib.import_module(module), name))


def test_engine_messages_are_keyword_only() -> None:
    module = importlib.import_module(MESSAGES)
    records = [cls for cls in vars(module).values()
               if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == module.__name__]
    assert records, f"{MESSAGES} defines no dataclass"
    for cls in records:
        _assert_keyword_only(cls)


def test_engine_stats_extend_the_scheduler_stats() -> None:
    from pagedllm.core.scheduler import SchedulerStats
    from pagedllm.engine.messages import EngineStats

    stats = EngineStats(**dataclasses.asdict(SchedulerStats(num_steps=3)), num_kv_blocks=7, block_size=16)
    assert (stats.num_steps, stats.num_kv_blocks, stats.block_size) == (3, 7, 16)
