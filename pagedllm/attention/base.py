"""The attention backend interface, the per-step input every backend starts from, and the registry.

A backend is one file: its metadata class, the builder that makes that metadata from the step's
``StepInputs`` (and decides the order of the step's requests, if it needs one), and the backend
itself (cache shape, forward). It becomes selectable with one ``register_backend`` line below.
"""
from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pagedllm import envs, platform
from pagedllm.attention import kv_quant
from pagedllm.errors import ValidationError
from pagedllm.layers.cpu_ops import active


@dataclass(kw_only=True)
class StepInputs:
    """One step's flat, unpadded batch (CPU tensors, built once per step by the worker): the model's
    inputs, the layout every backend's metadata builder starts from, and the rows that sample."""

    req_ids: list[str]
    """The step's requests in batch order (the order the backend's builder chose)."""
    input_ids: torch.Tensor
    """(num_tokens,) int64."""
    positions: torch.Tensor
    """(num_tokens,) int64."""
    query_start_loc: torch.Tensor
    """(num_reqs + 1,) int32: request i's tokens are [query_start_loc[i], query_start_loc[i+1])."""
    seq_lens: torch.Tensor
    """(num_reqs,) int32: computed + scheduled tokens of each request after this step."""
    block_tables: torch.Tensor
    """(num_reqs, max_blocks) int32 physical block ids, padded with the null block 0."""
    slot_mapping: torch.Tensor
    """(num_tokens,) int64: cache slot of each new token."""
    block_size: int
    sample_rows: list[int]
    """Indices into req_ids of the requests that sample a token this step."""
    logits_indices: torch.Tensor
    """(len(sample_rows),) int64: the token row whose hidden state gives each sample."""

    @property
    def query_lens(self) -> torch.Tensor:
        """(num_reqs,) int64 tokens of each request in this step."""
        qsl = self.query_start_loc.long()
        return qsl[1:] - qsl[:-1]


class AttentionMetadataBuilder(ABC):
    """Makes one backend's per-step metadata; one instance per model runner."""

    def order(self, num_scheduled: dict[str, int]) -> list[str]:
        """The batch order of the step's requests (``num_scheduled``: request -> tokens, in the
        scheduler's order). Default: the scheduler's order."""
        return list(num_scheduled)

    @abstractmethod
    def build(self, step: StepInputs) -> Any:
        """This backend's metadata for one step, built once and shared by all layers."""

    def build_for_graph(self, step: StepInputs, max_seq_len: int) -> Any:
        """Metadata of a decode-only step replayed from a CUDA graph: ``step``'s tensors are the graph's
        static buffers on the device (used as they are, refilled before each replay), and every choice
        that depends on lengths is made once for ``max_seq_len``. Only backends with
        ``supports_cuda_graphs`` implement it."""
        raise NotImplementedError(f"{type(self).__name__} has no CUDA-graph path")


class AttentionBackend(ABC):
    """Computes paged attention; one instance per model runner."""

    name: ClassVar[str] = ""
    builder_cls: ClassVar[type[AttentionMetadataBuilder]]
    supports_cuda_graphs: ClassVar[bool] = False
    """Its decode steps can be captured in a CUDA graph (its builder implements build_for_graph)."""
    supports_int8_kv: ClassVar[bool] = False
    """It reads and writes the int8 KV cache (kv_cache_dtype="int8", layout in ``kv_quant``)."""

    @staticmethod
    @abstractmethod
    def is_available() -> bool:
        """Whether this backend can run on this machine (the registry asks the same function)."""

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype | None = None) -> tuple[int, ...]:
        """Shape of one layer's cache tensor: K and V stacked, each head's block one contiguous run
        (block_size * head_dim values), so a head's context streams block by block. An int8 cache
        holds each head's block as block_size * (head_dim + 2) bytes: values, then per-slot scales."""
        if dtype == torch.int8:
            return (2, num_blocks, num_kv_heads, kv_quant.head_block_bytes(block_size, head_dim, dtype))
        return (2, num_blocks, num_kv_heads, block_size, head_dim)

    def make_builder(self) -> AttentionMetadataBuilder:
        """A metadata builder for this backend."""
        return self.builder_cls()

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: Any, scale: float, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        """q (tokens, heads, head_dim), k/v (tokens, kv_heads, head_dim) -> (tokens, heads, head_dim).

        ``metadata`` is what this backend's builder built for the step. Writes k/v into their
        slots of ``kv_cache`` first. With ``sliding_window`` W, the query at position p attends to
        positions p - W + 1 .. p only (a per-layer choice: Gemma alternates). ``logits_soft_cap`` c:
        each scaled score s becomes c * tanh(s / c) before the softmax (Gemma 2).
        """


def cpu_kernels_available() -> bool:
    """The compiled kernels of this CPU's level (or a lower one) loaded."""
    return active() is not None


def always_available() -> bool:
    """Backends in plain torch ops run wherever torch does."""
    return True


def triton_available() -> bool:
    """Triton is installed, and there is a CUDA device or Triton's interpreter is on (TRITON_INTERPRET=1)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or envs.TRITON_INTERPRET.read()


@dataclass(frozen=True, kw_only=True)
class BackendEntry:
    """A registered backend: where its class is, and whether it can run here (answered without
    importing it)."""

    path: str
    """"module:Class", imported only when the backend is instantiated."""
    is_available: Callable[[], bool]
    """The backend class's own ``is_available`` (tests check they are the same function)."""
    needs: str = ""
    """What it takes to make it available, for the error when it is not."""


_BACKENDS: dict[str, BackendEntry] = {}
"""In order of preference for "auto"."""


def register_backend(name: str, path: str, is_available: Callable[[], bool], needs: str = "") -> None:
    """Make the backend at ``path`` ("module:Class") selectable as ``name``; ``needs`` says what makes
    it available (shown when it is asked for and is not)."""
    if not callable(is_available):
        raise TypeError(f"attention backend {name!r}: is_available must be a function answering whether it runs here")
    _BACKENDS[name] = BackendEntry(path=path, is_available=is_available, needs=needs)


register_backend("cpu", "pagedllm.attention.cpu_backend:CpuAttentionBackend", cpu_kernels_available,
                 "its compiled kernels: they did not build (see the warning above, or `pagedllm build-kernels`)")
register_backend("torch", "pagedllm.attention.torch_backend:TorchAttentionBackend", always_available)
# last: "auto" never takes it on a CPU (under the interpreter it is a test path, not a fast one)
register_backend("triton", "pagedllm.attention.triton_backend:TritonAttentionBackend", triton_available,
                 "`pip install triton` and a CUDA device, or TRITON_INTERPRET=1 (Triton's interpreter, slow)")


def registered_backends() -> dict[str, BackendEntry]:
    """Every registered backend by name, in order of preference."""
    return dict(_BACKENDS)


GPU_BACKENDS = ("triton",)
"""The backends that run on a CUDA device (the others read and write CPU tensors)."""


def resolve_backend_name(name: str, device: str = "cpu") -> str:
    """"auto" -> the first available backend for ``device`` (on a CPU: "cpu" where the compiled
    kernels run, else "torch"; on CUDA: "triton"); another name is kept if that backend runs on
    ``device`` here, else a ValidationError."""
    if name == "auto":
        fits = [n for n in _BACKENDS if (n in GPU_BACKENDS) == platform.is_cuda(device)]
        name = next((n for n in fits if _BACKENDS[n].is_available()), fits[0] if fits else "torch")
    if name not in _BACKENDS:
        raise ValidationError.bad_value("attention_backend", name, "'auto' or one of " + ", ".join(sorted(_BACKENDS)))
    if platform.is_cuda(device) and name not in GPU_BACKENDS:
        raise ValidationError(f"attention backend {name!r} runs on the CPU; on device 'cuda' use "
                              + " or ".join(repr(n) for n in GPU_BACKENDS), param="attention_backend", value=name)
    if not _BACKENDS[name].is_available():
        raise ValidationError(f"attention backend {name!r} is not available on this machine; it needs "
                              f"{_BACKENDS[name].needs or 'what this machine lacks'}", param="attention_backend",
                              value=name)
    return name


def backend_class(name: str) -> type[AttentionBackend]:
    """The class of a registered backend (imported on first use)."""
    assert name in _BACKENDS, f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}"
    module, cls = _BACKENDS[name].path.split(":")
    return getattr(importlib.import_module(module), cls)


def get_attention_backend(name: str) -> AttentionBackend:
    """Instantiate a registered backend by name (imported lazily)."""
    return backend_class(name)()
