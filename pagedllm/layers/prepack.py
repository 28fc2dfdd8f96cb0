"""oneDNN prepacked weights for bfloat16 matmuls on CPU.

``F.linear`` hands oneDNN a plain row-major weight, which it re-lays out into its blocked GEMM
format on every call; with few token rows (decode of a small batch) that re-layout costs as much
as the product. Packing once after loading skips it. Measured on 2 cores, SmolLM2-135M's four
projections + LM head, bf16: 1 row 1.89 -> 0.99 ms, 8 rows 2.27 -> 1.32 ms, 64 rows 5.75 -> 4.75 ms,
256 rows 17.8 -> 16.7 ms, 2048 rows 187 -> 182 ms per layer set; results are bit-identical.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.lru_cache(maxsize=1)
def _prepack_available() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    try:
        return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
                and hasattr(mkldnn, "_linear_pointwise") and bool(mkldnn._is_mkldnn_bf16_supported()))
    except (AttributeError, RuntimeError):
        return False


def can_prepack(weight: torch.Tensor) -> bool:
    """True for a bfloat16 CPU weight on a torch build whose oneDNN runs bf16 here."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2 and _prepack_available()


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """The (out, in) weight in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b through the packed weight when there is one, else ``F.linear``."""
    if packed is None:
        return F.linear(x, weight, bias)
    if x.dim() != 2 or not x.is_contiguous():
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (rows, in)
        out = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
        return out.view(*lead, out.shape[-1])  # (..., out)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
