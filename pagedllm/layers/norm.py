"""RMSNorm with the residual add fused in (computed as transformers' LlamaRMSNorm does), and an encoder's
LayerNorm of a residual sum."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.custom_op import CustomOp


def _rms_normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in float32."""
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(CustomOp):
    """x / rms(x) * weight, in float32 and cast back; optionally adds the residual first. ``forward`` is
    ``forward_cpu`` (one fused pass) where the kernels run, else ``forward_native`` (layers/custom_op.py)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        self.hidden_size = hidden_size
        super().__init__(dtype or torch.get_default_dtype())
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def kernels_suit(self) -> bool:
        return self.hidden_size >= 8  # narrower rows: a vector's worth, not worth a kernel call

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * _rms_normalized(x, self.eps).to(x.dtype)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual)."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As ``forward_native``, in one pass instead of add, float, pow, mean, rsqrt, mul, to, mul; x + residual
        is written into ``residual`` itself, which is returned. Rows other than (tokens, hidden): the native path."""
        if x.dim() != 2:
            return self.forward_native(x, residual)
        out = torch.empty_like(x)
        self.kernels.rms_norm(x, residual, self.weight, out, self.eps)
        return out if residual is None else (out, residual)


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in float32, cast back at the end (Gemma's order of rounding; its
    checkpoints store the weight as an offset from 1)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_rms_normalized(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class LayerNorm(CustomOp):
    """``nn.LayerNorm`` over the last dim (``weight``, ``bias``, ``eps``), optionally of ``x + residual`` (a
    post-LN encoder's block output): ``forward_cpu`` is one fused pass over rows of a 2-D input (the sum rounded
    to x's dtype as torch's add is; mean and variance in float32), ``forward_native`` torch's add and
    ``layer_norm``."""

    def __init__(self, hidden_size: int, eps: float = 1e-12, dtype: torch.dtype | None = None) -> None:
        self.hidden_size = hidden_size
        super().__init__(dtype or torch.get_default_dtype())
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        h = x if residual is None else x + residual
        return torch.nn.functional.layer_norm(h, (self.hidden_size,), self.weight, self.bias, self.eps)

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or x.stride(1) != 1 or (residual is not None and residual.stride(-1) != 1):
            return self.forward_native(x, residual)
        assert self.kernels is not None
        return self.kernels.layer_norm(x, residual, self.weight, self.bias, self.eps)
