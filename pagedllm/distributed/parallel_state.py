"""Which tensor-parallel rank this process is. At tp=1 (no process group) rank 0 of 1."""
from __future__ import annotations

import torch.distributed as dist


def get_tp_world_size() -> int:
    """Ranks that share each layer."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def get_tp_rank() -> int:
    """This process's rank among them."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def divide(numerator: int, denominator: int) -> int:
    """Exact division of a layer dimension across ranks."""
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator
