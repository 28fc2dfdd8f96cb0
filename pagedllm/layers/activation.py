"""Activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """(tokens, 2*d) packed [gate, up] -> (tokens, d) silu(gate) * up; ``forward_cpu`` in one pass where the
    kernels run (layers/custom_op.py)."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """One pass instead of chunk, silu, mul (rows other than (tokens, 2*d): the native path)."""
        if x.dim() != 2:
            return self.forward_native(x)
        out = x.new_empty(x.shape[0], x.shape[1] // 2)  # (tokens, d)
        self.kernels.silu_and_mul(x, out)
        return out


class GeluAndMul(nn.Module):
    """(tokens, 2*d) packed [gate, up] -> (tokens, d) gelu_tanh(gate) * up (Gemma's GeGLU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def get_act_fn(name: str) -> nn.Module:
    """The (ungated) MLP activation a config names: GPT-2's "gelu_new" is GELU's tanh approximation."""
    from pagedllm.errors import ValidationError

    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return nn.GELU(approximate="tanh")
    if name == "gelu":
        return nn.GELU()
    if name == "relu":
        return nn.ReLU()
    raise ValidationError.bad_value("activation_function", name, "'gelu_new', 'gelu' or 'relu'")
