"""Which tensor-parallel rank and pipeline stage this process is, and how layers and their dimensions split.

At tp=1 and pp=1 (no process group) every process is rank 0 of 1. Workers of a parallel engine call
``init_distributed`` before they build the model: the layers read their rank, and the model its stage's layers
(``get_pp_stage``), when they are constructed. Global rank = stage * tp + tensor-parallel rank.
"""
from __future__ import annotations

import dataclasses
import datetime

import torch.distributed as dist

from pagedllm.distributed.shm_comm import ShmCommunicator, shm_usable
from pagedllm.errors import ValidationError

_shm: ShmCommunicator | None = None
"""This process's shared-memory collectives, when every rank of its group is on this machine."""


@dataclasses.dataclass(frozen=True)
class PipelineStage:
    """This process's pipeline stage: which of the model's layers it holds, [start, end)."""

    rank: int
    size: int
    start: int
    end: int

    @property
    def is_first(self) -> bool:
        """It embeds the tokens."""
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        """It holds the final norm and the LM head, and samples."""
        return self.rank == self.size - 1


_pp: PipelineStage | None = None
"""Set by ``init_distributed`` at pipeline_parallel_size > 1 (None: the whole model here)."""
_tp_size = 1
_tp_group: dist.ProcessGroup | None = None
"""This stage's tensor-parallel group (None: the default group, every rank: no pipeline)."""


def get_tp_world_size() -> int:
    """Ranks that share each layer."""
    return _tp_size if dist.is_available() and dist.is_initialized() else 1


def get_tp_rank() -> int:
    """This process's rank among them."""
    return dist.get_rank() % _tp_size if dist.is_available() and dist.is_initialized() else 0


def get_tp_group() -> dist.ProcessGroup | None:
    """The group the tensor-parallel collectives run in (None: the default group)."""
    return _tp_group


def get_pp_stage() -> PipelineStage | None:
    """This process's pipeline stage (None at pipeline_parallel_size 1: every layer is here)."""
    return _pp


def init_distributed(rank: int, world_size: int, init_method: str, local_world_size: int = 1,
                     backend: str = "gloo", timeout_s: float = 600.0,
                     stages: list[tuple[int, int]] | None = None) -> None:
    """Join the process group (``init_method``: "tcp://host:port", rank 0 hosts the store). ``stages``: at
    pipeline_parallel_size > 1, each stage's layers [start, end) (``layer_partition``); the ranks are then
    ``len(stages)`` stages of ``world_size / len(stages)`` tensor-parallel ranks.

    When all the ranks of a tensor-parallel group are on this machine (``local_world_size``), its collectives go
    through shared memory (distributed/shm_comm.py) instead of gloo's TCP.
    """
    global _shm, _pp, _tp_size, _tp_group
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    _tp_size = world_size // len(stages) if stages else world_size
    first = rank - rank % _tp_size  # this tensor-parallel group's first global rank
    if stages:
        _pp = PipelineStage(rank // _tp_size, len(stages), *stages[rank // _tp_size])
        if _tp_size > 1:  # every rank makes every group, in the same order (torch's rule)
            groups = [dist.new_group(list(range(s * _tp_size, (s + 1) * _tp_size))) for s in range(len(stages))]
            _tp_group = groups[_pp.rank]
    if backend == "gloo" and _tp_size > 1 and local_world_size == world_size and shm_usable(_tp_size, _tp_size):
        _shm = ShmCommunicator(rank - first, _tp_size, _tp_group, first)  # CPU tensors only, one machine


def get_shm_communicator() -> ShmCommunicator | None:
    """The shared-memory collectives of this process's group, if it has them."""
    return _shm


def destroy_distributed() -> None:
    """Leave the group (no-op when there is none)."""
    global _shm, _pp, _tp_size, _tp_group
    _pp, _tp_size, _tp_group = None, 1, None
    if _shm is not None:
        _shm.close()
        _shm = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def layer_partition(num_layers: int, pp: int, partition: str | None = None) -> list[tuple[int, int]]:
    """Each pipeline stage's layers [start, end): ``partition`` ("8,8,7,7": layers per stage, vLLM's
    VLLM_PP_LAYER_PARTITION) or an even split, the first stages one longer where it does not divide (ValidationError
    naming pp_layer_partition or pipeline_parallel_size where it cannot be done)."""
    if partition is None:
        if pp > num_layers:
            raise ValidationError(f"pipeline_parallel_size {pp} exceeds the model's {num_layers} layers (each stage "
                                  "holds at least one)", param="pipeline_parallel_size", value=pp)
        counts = [split_evenly(num_layers, pp, i)[1] for i in range(pp)]
    else:
        try:
            counts = [int(part) for part in partition.split(",")]
        except ValueError:
            counts = []
        if len(counts) != pp or any(n < 1 for n in counts) or sum(counts) != num_layers:
            raise ValidationError(f"pp_layer_partition must be {pp} positive layer counts, one per stage and comma "
                                  f"separated, that sum to the model's {num_layers} layers", param="pp_layer_partition",
                                  value=partition)
    starts = [sum(counts[:i]) for i in range(pp)]
    return [(start, start + n) for start, n in zip(starts, counts)]


def divide(numerator: int, denominator: int) -> int:
    """Exact division of a layer dimension across ranks."""
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


def split_evenly(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part ``index`` when ``total`` is split into ``parts`` near-equal runs
    (the first ``total % parts`` runs one longer): 10 into 3 -> 4, 3, 3."""
    size, extra = divmod(total, parts)
    start = index * size + min(index, extra)
    return start, size + (1 if index < extra else 0)


@dataclasses.dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds: query heads [q_start, q_start + num_heads) and KV heads
    [kv_start, kv_start + num_kv_heads), with every query head's KV head among them."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def shard_heads(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadShard:
    """Split attention heads across ranks along GQA groups (a query head never leaves its KV head).

    With at least as many KV heads as ranks, KV heads split evenly (uneven when they do not
    divide: 3 KV heads on 2 ranks -> 2 and 1) and each rank takes the query heads of its KV
    heads. With fewer KV heads than ranks, each KV head is replicated on ``tp_size //
    num_kv_heads`` ranks that split its query heads (as vLLM replicates them).
    """
    if num_heads % num_kv_heads:
        raise ValidationError(f"{num_heads} attention heads do not form groups over {num_kv_heads} KV heads",
                              param="tensor_parallel_size", value=tp_size)
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        kv_start, kv_count = split_evenly(num_kv_heads, tp_size, tp_rank)
        return HeadShard(kv_start * group, kv_count * group, kv_start, kv_count)
    if tp_size % num_kv_heads:
        raise ValidationError(
            f"tensor_parallel_size {tp_size} must be a multiple of the model's {num_kv_heads} KV heads when it "
            "exceeds them (each KV head is replicated on the same number of ranks)",
            param="tensor_parallel_size", value=tp_size)
    replicas = tp_size // num_kv_heads
    if group < replicas:
        raise ValidationError(f"tensor_parallel_size {tp_size} exceeds the model's {num_heads} attention heads",
                              param="tensor_parallel_size", value=tp_size)
    kv_head = tp_rank // replicas
    q_start, q_count = split_evenly(group, replicas, tp_rank % replicas)
    return HeadShard(kv_head * group + q_start, q_count, kv_head, 1)
