"""Prepacked bfloat16 weights for CPU matmuls.

``F.linear`` hands oneDNN a plain row-major weight, which it re-lays out into its blocked GEMM
format on every call; with few token rows (decode of a small batch) that re-layout costs as much
as the product. Packing once after loading skips it. Two packers:

- our AVX512-BF16 GEMM (csrc/gemm_bf16.cpp) where it builds, the CPU has no AMX (oneDNN's AMX
  tiles are faster there) and the shape suits it (out % 16 == 0, in even). On 2 cores, all 30
  layers of SmolLM2-135M with weights streamed from memory: 1 row 6.2 -> 4.2 ms, 16 rows 8.1 ->
  6.7, 64 rows 19.5 -> 16.3, 256 rows 56.3 -> 53.6, 2,048 rows 427 -> 418 against oneDNN's
  prepacked matmul; the LM head 1.23 -> 0.99 ms (1 row), 14.6 -> 14.3 ms (256 rows).
- otherwise (or with ``PAGEDLLM_GEMM=onednn``) oneDNN's own packed layout
  (``_reorder_linear_weight``): against ``F.linear``, 1 row 1.89 -> 0.99 ms, 8 rows 2.27 -> 1.32,
  256 rows 17.8 -> 16.7 per layer set; bit-identical.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from pagedllm.layers.cpu_ops import cpu_flags, fused_ops, load_ops


@functools.lru_cache(maxsize=1)
def _prepack_available() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    try:
        return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
                and hasattr(mkldnn, "_linear_pointwise") and bool(mkldnn._is_mkldnn_bf16_supported()))
    except (AttributeError, RuntimeError):
        return False


def _own_gemm_suits(weight: torch.Tensor) -> bool:
    out_features, in_features = weight.shape
    if os.environ.get("PAGEDLLM_GEMM") == "onednn":  # for A/B measurements
        return False
    return (out_features % 16 == 0 and in_features % 2 == 0 and "amx_bf16" not in cpu_flags()
            and fused_ops(weight) is not None)


def can_prepack(weight: torch.Tensor) -> bool:
    """True for a bfloat16 2-D CPU weight that one of the two packers takes."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return False
    return _own_gemm_suits(weight) or _prepack_available()


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """The (out, in) weight packed: a 1-D bf16 tensor for our GEMM, or an opaque mkldnn tensor."""
    weight = weight.detach().contiguous()
    if _own_gemm_suits(weight):
        return fused_ops(weight).gemm_pack(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def silu_interleave(features: int) -> torch.Tensor | None:
    """Row order of a packed [gate; up] weight (2 * features, in) for the GEMM's fused SiLU: 32 gate
    rows then the 32 matching up rows, block by block. None where the fused form does not apply."""
    if features % 32:
        return None
    gate = torch.arange(features).view(-1, 32)  # (blocks, 32)
    return torch.cat([gate, gate + features], dim=1).reshape(-1)  # (2 * features,)


def _own_gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, silu_and_mul: bool) -> torch.Tensor:
    x2 = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, x.shape[-1]).contiguous()  # (rows, in)
    out = load_ops().gemm_bf16(x2, packed, packed.numel() // x2.shape[1], bias, silu_and_mul)  # (rows, out)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])  # (..., out)


def silu_and_mul_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T) through a weight packed in ``silu_interleave`` order."""
    return _own_gemm(x, packed, bias, True)


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b through the packed weight when there is one, else ``F.linear``."""
    if packed is None:
        return F.linear(x, weight, bias)
    if not packed.is_mkldnn:
        return _own_gemm(x, packed, bias, False)
    x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()  # (rows, in)
    out = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])  # (..., out)
