"""CPU backend: the torch backend, with decode tokens attended by a C++ kernel that reads the
paged K/V cache in place (no gathered copy, no padding to the longest sequence).

Measured on 2 cores (256 sequences x 192 tokens, 9 query / 3 KV heads, bfloat16): 3.5 ms per
layer against 6.0 ms for the torch backend's gather + SDPA. The kernel is compiled on first
use with torch.utils.cpp_extension (cached under ~/.cache/torch_extensions); where it cannot
be built the engine falls back to the torch backend.
"""
from __future__ import annotations

import functools
import logging
import os
from types import ModuleType

import torch

from pagedllm.attention.base import CommonAttentionMetadata
from pagedllm.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "paged_decode.cpp")


@functools.lru_cache(maxsize=1)
def load_kernel() -> ModuleType:
    """Build (or load the cached build of) the C++ decode kernel."""
    from torch.utils.cpp_extension import load

    logger.info("loading the C++ paged decode kernel (built once, then cached)")
    # -march=native: the build is cached per machine. -fopenmp: at::parallel_for's pragmas are
    # compiled here; they bind to the libgomp.so.1 torch already loaded, so one thread pool serves both
    return load(name="pagedllm_paged_decode", sources=[_SOURCE], verbose=False,
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],  # fast-math: vector exp
                extra_ldflags=["-fopenmp", "-lmvec"])


@functools.lru_cache(maxsize=1)
def kernel_available() -> bool:
    """True when the kernel builds and loads here (a failure is logged once)."""
    try:
        load_kernel()
    except Exception as e:  # no compiler, no ninja, a build error: the torch backend serves instead
        logger.warning("C++ paged decode kernel unavailable (%s); using the torch attention backend", e)
        return False
    return True


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        metadata = super().build_metadata(common)
        nd = common.num_decodes
        if nd:
            max_blocks = -(-int(common.seq_lens[:nd].max()) // common.block_size)
            metadata.decode_tables = common.block_tables[:nd, :max_blocks].contiguous()  # (nd, max_blocks) int32
            metadata.decode_seq_lens = common.seq_lens[:nd].contiguous()  # (nd,) int32
        return metadata

    @staticmethod
    def _decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                metadata: TorchAttentionMetadata, scale: float) -> torch.Tensor:
        q = q.contiguous()
        out = torch.empty_like(q)
        load_kernel().paged_decode(q, key_cache, value_cache, metadata.decode_tables, metadata.decode_seq_lens, out,
                                   scale)
        return out
