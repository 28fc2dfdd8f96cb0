"""Layers with more than one implementation, the choice made once when the model loads (after vLLM's ``CustomOp``).

A ``CustomOp`` has ``forward_native`` (torch's own ops: every device, the reference the others are tested
against) and may have ``forward_cpu`` (the compiled kernels of layers/cpu_ops.py, in ``self.kernels``) and
``forward_cuda`` (default: the native one). ``bind(device)`` picks one and makes it the module's ``forward``
itself (no dispatching frame in between): at construction for the host CPU, where a model is built, and again
through ``bind_ops`` when the worker has moved the loaded model to its device. So ``forward`` asks nothing of
the platform, the kernel level or the switches per call; what is decided then is the argument's layout only
(e.g. a 3-D input takes the native path). ``cpu_ops.use_level`` and ``cpu_ops.torch_ops_only`` therefore act
on the layers built (or bound) inside them. tests/test_kernel_choice.py holds every op to this.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm import platform
from pagedllm.layers import cpu_ops

HOST = torch.device("cpu")


class CustomOp(nn.Module):
    """Base of a layer whose implementation is chosen once per device (module docstring)."""

    kernels: cpu_ops.CpuKernels | None
    """The compiled kernels ``forward_cpu`` calls; None where the native (or CUDA) implementation is bound."""

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        """``dtype``: what the op runs in (None: any the kernels take; the engine runs only those)."""
        super().__init__()
        self.op_dtype = dtype
        self.bind(HOST)

    def bind(self, device: torch.device | str) -> None:
        """Make the implementation for ``device`` (and the active kernel level) the module's ``forward``."""
        device = torch.device(device)
        self.kernels = cpu_ops.kernels_for(device, self.op_dtype) if self.kernels_suit() else None
        if self.kernels is not None:
            self.forward = self.forward_cpu
        elif platform.is_cuda(device):
            self.forward = self.forward_cuda
        else:
            self.forward = self.forward_native

    def kernels_suit(self) -> bool:
        """Whether this op's shape (known at construction) suits the compiled kernels."""
        return True

    @property
    def implementation(self) -> str:
        """The name of the bound method: "forward_native", "forward_cpu" or "forward_cuda"."""
        return self.forward.__name__

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        """The compiled kernels' path (only bound where ``self.kernels`` is set); default: the native one."""
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)


def bind_ops(model: nn.Module, device: torch.device | str) -> list[CustomOp]:
    """Bind every CustomOp of ``model`` to ``device`` (once, when the loaded model is on it); returns them."""
    ops = [m for m in model.modules() if isinstance(m, CustomOp)]
    for op in ops:
        op.bind(device)
    return ops
