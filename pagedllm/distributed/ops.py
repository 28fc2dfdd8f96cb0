"""Collectives used by tensor-parallel layers; each returns its input unchanged at tp=1."""
from __future__ import annotations

import torch
import torch.distributed as dist

from pagedllm.distributed.parallel_state import get_shm_communicator, get_tp_group, get_tp_world_size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks (in place)."""
    if get_tp_world_size() == 1:
        return x
    shm = get_shm_communicator()
    if shm is not None:
        return shm.all_reduce(x)
    dist.all_reduce(x, group=get_tp_group())
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``."""
    world = get_tp_world_size()
    if world == 1:
        return x
    shm = get_shm_communicator()
    if shm is not None:
        return shm.all_gather(x, dim)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=get_tp_group())
    return torch.cat(parts, dim=dim)
