"""A worker's sleep and wake-up (vLLM's sleep mode, on our memory): what is released is gone from the process.

Level 1 drops the KV pools (device and host) and, on a GPU, the CUDA graphs that hold their addresses; the
weights stay (vLLM offloads them to host memory: on a CPU they are there already). Level 2 drops the model
runner too: its weights, a draft model's, the LoRA slots and the per-request states. ``wake_up(["weights"])``
builds the runner again from the model files (vLLM leaves level-2 weights for the caller to reload; reading the
checkpoint again is the one reload a CPU engine has), ``wake_up(["kv_cache"])`` allocates the pools again (after
the weights, when both slept). The engine core (engine/lifecycle.py) first takes every request's K/V away from
the scheduler, so nothing refers to the released memory.
"""
from __future__ import annotations

import gc
import logging
from typing import Any, Protocol

import torch

from pagedllm import platform
from pagedllm.platform import heap

logger = logging.getLogger(__name__)

SLEEP_TAGS = ("weights", "kv_cache")
"""What sleep releases, by wake_up's tag names (vLLM's)."""


class Worker(Protocol):
    """What sleep and wake-up use of a worker (worker/worker.py's Worker; named here, not imported: it imports
    this module)."""
    device: torch.device
    model_runner: Any
    backend: Any
    asleep: set[str]
    _kv_blocks: tuple[int, int]

    def load_model(self) -> None: ...

    def initialize_cache(self, num_blocks: int, num_host_blocks: int) -> None: ...

    def compile_or_warm_up_model(self) -> None: ...


def _release(worker: Worker) -> None:
    """Give freed memory back to the system (the allocator's cached pages, malloc's free lists)."""
    gc.collect()
    if platform.is_cuda(worker.device):
        torch.cuda.empty_cache()
    heap.trim()


def sleep_worker(worker: Worker, level: int) -> None:
    """Release the KV pools (level >= 1) and the model runner (level 2); idempotent."""
    assert level in (1, 2), level
    runner = worker.model_runner
    if runner is not None:
        for layer in runner._attention_layers():
            layer.kv_cache = None
        runner.kv_caches, runner.host_kv_caches = [], []
        runner.graphs = None  # (a GPU's graphs read the pools' addresses)
        if level == 2:
            worker.model_runner = None
    worker.asleep.add("kv_cache")
    if level == 2:
        worker.asleep.add("weights")
    _release(worker)


def wake_worker(worker: Worker, tags: list[str]) -> None:
    """Bring back the tags' memory: "weights" rebuilds the runner (read from the model files) where level 2
    dropped it, "kv_cache" allocates the pools (at once, or with the weights when those still sleep)."""
    if "weights" in tags and worker.model_runner is None:
        worker.load_model()
    worker.asleep -= set(tags)
    if worker.model_runner is not None and "kv_cache" not in worker.asleep and not worker.model_runner.kv_caches:
        blocks, host_blocks = worker._kv_blocks
        if blocks:
            worker.initialize_cache(blocks, host_blocks)
            worker.compile_or_warm_up_model()  # (a GPU's graphs read the new pools' addresses)
