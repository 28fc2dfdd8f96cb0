"""The attention backend interface and its registry.

A backend writes the step's new K/V into their cache slots and computes attention over the
paged cache for a flat, unpadded batch in which decode tokens (query length 1) come first.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.errors import ValidationError
from pagedllm.layers.cpu_ops import active


@dataclass
class CommonAttentionMetadata:
    """The batch layout every backend starts from (CPU tensors, built once per step)."""

    query_start_loc: torch.Tensor
    """(num_reqs + 1,) int32: request i's tokens are [query_start_loc[i], query_start_loc[i+1])."""
    seq_lens: torch.Tensor
    """(num_reqs,) int32: computed + scheduled tokens of each request after this step."""
    block_tables: torch.Tensor
    """(num_reqs, max_blocks) int32 physical block ids, padded with the null block 0."""
    slot_mapping: torch.Tensor
    """(num_tokens,) int64: cache slot of each new token."""
    num_decodes: int
    """The first num_decodes requests have exactly one query token."""
    block_size: int


class AttentionBackend(ABC):
    """Computes paged attention; one instance per model runner."""

    name: str = ""

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor: K and V stacked, each head's block one contiguous run
        (block_size * head_dim values), so a head's context streams block by block."""
        return (2, num_blocks, num_kv_heads, block_size, head_dim)

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """Backend-specific metadata for one step, built once and shared by all layers."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: Any, scale: float) -> torch.Tensor:
        """q (tokens, heads, head_dim), k/v (tokens, kv_heads, head_dim) -> (tokens, heads, head_dim).

        Writes k/v into their slots of ``kv_cache`` first.
        """


def _cpu_kernels_available() -> bool:
    return active() is not None


@dataclass(frozen=True)
class BackendEntry:
    """A registered backend: where its class is, and whether it can run here (answered without
    importing it)."""

    path: str
    """"module:Class", imported only when the backend is instantiated."""
    is_available: Callable[[], bool]


_BACKENDS: dict[str, BackendEntry] = {
    "cpu": BackendEntry("pagedllm.attention.cpu_backend:CpuAttentionBackend", _cpu_kernels_available),
    "torch": BackendEntry("pagedllm.attention.torch_backend:TorchAttentionBackend", lambda: True),
}
"""In order of preference for "auto"."""


def resolve_backend_name(name: str) -> str:
    """"auto" -> the first available backend ("cpu" where the compiled kernels run, else "torch");
    another name is kept if that backend is available here, else a ValidationError."""
    if name == "auto":
        return next(n for n, entry in _BACKENDS.items() if entry.is_available())
    if name not in _BACKENDS:
        raise ValidationError.bad_value("attention_backend", name, "'auto' or one of " + ", ".join(sorted(_BACKENDS)))
    if not _BACKENDS[name].is_available():
        raise ValidationError(f"attention backend {name!r} is not available on this machine (its kernels did not "
                              "build: see the warning above, or `pagedllm build-kernels`)", param="attention_backend",
                              value=name)
    return name


def get_attention_backend(name: str) -> AttentionBackend:
    """Instantiate a registered backend by name (imported lazily)."""
    assert name in _BACKENDS, f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}"
    module, cls = _BACKENDS[name].path.split(":")
    return getattr(importlib.import_module(module), cls)()
