"""All-reduce and all-gather through shared memory, for ranks on one machine.

Gloo over loopback TCP takes 1-2 ms per all-reduce of a few KB on a 2-core VM (measured:
docs/BENCHMARKS.md, "Tensor parallelism"), and a decode step makes two per layer. Ranks that
share a machine instead write their part into their slot of one shared buffer, raise their
counter, wait until every counter reached this operation, and each reads all slots in rank
order (so every rank computes the same bits). Two buffers alternate: a rank can only start
operation k + 2 after every rank started k + 1, i.e. finished reading k.

The buffer is a file in /dev/shm that rank 0 creates and unlinks as soon as every rank has
mapped it: nothing is left behind, however the processes end. x86 only (its stores are seen in
program order; elsewhere the collectives stay on gloo).
"""
from __future__ import annotations

import mmap
import os
import platform
import uuid

import numpy as np
import torch
import torch.distributed as dist

from pagedllm import envs

SHM_ENV = envs.CPU_SHM_ALLREDUCE.name
"""Set to 0 to keep every collective on gloo (A/B measurements)."""
SLOT_BYTES = 8 << 20
"""Bytes one rank writes per operation; larger tensors go through in chunks."""
_FLAG_STRIDE = 8  # int64s between two ranks' counters: each on its own 64-byte cache line
_SPINS_BEFORE_YIELD = 64


def shm_usable(world_size: int, local_world_size: int) -> bool:
    """Whether the ranks can share memory: all on this machine, x86, not turned off."""
    return (world_size > 1 and local_world_size == world_size and envs.CPU_SHM_ALLREDUCE.read()
            and platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm"))


class ShmCommunicator:
    """The shared buffer of one tensor-parallel group (every rank constructs it, collectively)."""

    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup | None = None, first: int = 0) -> None:
        """``rank`` of ``world_size``: this process's place in its group (``group``: None, the default one; else a
        pipeline stage's tensor-parallel group, whose first global rank is ``first``)."""
        self.rank, self.world = rank, world_size
        flags_bytes = world_size * _FLAG_STRIDE * 8
        size = flags_bytes + 2 * world_size * SLOT_BYTES
        name = [f"/dev/shm/pagedllm-tp-{uuid.uuid4().hex}" if rank == 0 else None]
        if rank == 0:
            fd = os.open(name[0], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)
        dist.broadcast_object_list(name, src=first, group=group)
        if rank != 0:
            fd = os.open(name[0], os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        dist.barrier(group=group)  # every rank has it mapped: the name can go
        if rank == 0:
            os.unlink(name[0])
        self.flags = np.frombuffer(self._map, dtype=np.int64, count=world_size * _FLAG_STRIDE)[::_FLAG_STRIDE]
        data = torch.frombuffer(self._map, dtype=torch.uint8, offset=flags_bytes)
        self.slots = data.view(2, world_size, SLOT_BYTES)  # (buffer, rank, bytes)
        self.ops = 0

    def _exchange(self, part: torch.Tensor) -> list[torch.Tensor]:
        """Publish ``part`` (at most SLOT_BYTES) and return every rank's part, in rank order."""
        buf = self.slots[self.ops % 2]
        nbytes = part.numel() * part.element_size()
        mine = buf[self.rank, :nbytes].view(part.dtype).view(part.shape)  # (same shape as part)
        mine.copy_(part)
        self.ops += 1
        self.flags[self.rank] = self.ops  # after the copy: x86 keeps the two stores in order
        spins = 0
        while self.flags.min() < self.ops:
            spins += 1
            if spins > _SPINS_BEFORE_YIELD:
                os.sched_yield()  # more ranks than free cores: let the late one run
        return [buf[r, :nbytes].view(part.dtype).view(part.shape) for r in range(self.world)]

    def _chunks(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Views of flat ``x`` that fit a slot."""
        flat = x.reshape(-1)  # (numel,)
        step = SLOT_BYTES // x.element_size()
        return [flat[i:i + step] for i in range(0, flat.numel(), step)]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (float32 accumulation, in rank order on every rank)."""
        x_contig = x.contiguous()
        for chunk in self._chunks(x_contig):
            parts = self._exchange(chunk)
            total = parts[0].to(torch.float32, copy=True)  # never in place: the slots are every rank's to read
            for p in parts[1:]:
                total += p
            chunk.copy_(total)
        if x_contig.data_ptr() != x.data_ptr():
            x.copy_(x_contig)
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``."""
        x = x.contiguous()
        if x.numel() * x.element_size() <= SLOT_BYTES:
            return torch.cat([p.clone() for p in self._exchange(x)], dim=dim)
        gathered = [torch.empty_like(x) for _ in range(self.world)]  # chunk by chunk, rank by rank
        for out_chunks in zip(*(self._chunks(g) for g in gathered), self._chunks(x)):
            *targets, chunk = out_chunks
            for target, part in zip(targets, self._exchange(chunk)):
                target.copy_(part)
        return torch.cat(gathered, dim=dim)

    def close(self) -> None:
        """Unmap the buffer (if no tensor still points into it; else the process's exit does)."""
        del self.flags, self.slots
        try:
            self._map.close()
        except BufferError:
            pass
