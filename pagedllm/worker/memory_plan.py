"""What each rank of an engine will hold, known from the config before any weight is read: its pipeline stage's
layers' weights (its tensor-parallel share of them) and its KV pool. ``check_ranks`` refuses a plan whose rank is
over worker_memory_limit, ``check_machine`` one whose ranks on one machine are over what it has (this machine's for
the uni and mp executors; each Ray node's once its actors are placed), both naming the figures.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import torch
from torch import nn

from pagedllm.attention import kv_quant
from pagedllm.config import CacheConfig, EngineConfig
from pagedllm.distributed.parallel_state import layer_partition, shard_heads
from pagedllm.errors import ValidationError
from pagedllm.models.config import ArchConfig

GIB = 1024**3
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
"""A decoder layer's tensor ("model.layers.7.mlp.down_proj.weight"): it lives on the stage holding layer 7."""


@dataclasses.dataclass(frozen=True)
class WeightBytes:
    """A model's weights in host memory, all ranks together."""

    loading: int
    """The most they take while loading (quantization="int8": the float weights, before they become rows)."""
    final: int
    """What they take once processed (packed copies included)."""
    head_copy: int = 0
    """Of ``final``: the packed copy of an LM head tied to the embedding (at pp > 1 the last stage's head is a
    tensor of its own, packed in place: no copy)."""


@dataclasses.dataclass(frozen=True)
class RankBytes:
    """One rank's share of the model and its KV pool, in bytes."""

    stage: int
    tp_rank: int
    layers: tuple[int, int]
    """Its stage's decoder layers [start, end)."""
    weights_loading: int
    """Its weights at their most while loading (quantization="int8": before they become rows)."""
    weights: int
    """Its weights once processed (packed copies, rows kept quantized)."""
    kv: int
    """Its KV pool (and host swap blocks) as asked: num_kv_blocks, kv_cache_memory, or the least it accepts."""

    @property
    def need(self) -> int:
        """The most it holds: while loading, or once loaded with its KV pool."""
        return max(self.weights_loading, self.weights + self.kv)

    def describe(self, pp: int, tp: int) -> str:
        """Which rank it is, in words ("stage 1 of 2 (layers 12-23), tensor-parallel rank 0")."""
        where = [] if pp == 1 else [f"stage {self.stage} of {pp} (layers {self.layers[0]}-{self.layers[1] - 1})"]
        where += [] if tp == 1 else [f"tensor-parallel rank {self.tp_rank}"]
        return ", ".join(where) or "the worker"


def kv_block_bytes(arch: ArchConfig, num_kv_heads: int, block_size: int, kv_dtype: torch.dtype,
                   draft: ArchConfig | None = None, num_layers: int | None = None) -> int:
    """Bytes of one KV block of one rank holding ``num_kv_heads`` of the model's KV heads (K and V of every
    layer, or of ``num_layers``: a pipeline stage's; an int8 cache's scales included), a draft model's layers
    included (its K/V sit in the same blocks, all its heads on every rank)."""
    layers = arch.num_layers if num_layers is None else num_layers
    total = 2 * layers * num_kv_heads * kv_quant.head_block_bytes(block_size, arch.head_dim, kv_dtype)
    if draft is not None:
        total += 2 * draft.num_layers * draft.num_kv_heads * kv_quant.head_block_bytes(block_size, draft.head_dim,
                                                                                      kv_dtype)
    return total



def stage_tensor_bytes(model: nn.Module, stages: Sequence[tuple[int, int]], tp: int) -> list[int]:
    """Bytes one tensor-parallel rank of each stage holds of ``model``'s tensors as built (on the meta device):
    a decoder layer's on its stage, the embedding on the first, the final norm and LM head on the last (a tied
    head is its own tensor there at pp > 1), anything else (rotary tables) on every stage; a weight matrix split
    ``tp`` ways (linear layers, the vocab-parallel embedding and head), vectors and buffers whole."""
    out, seen, last = [0] * len(stages), set(), len(stages) - 1
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        if (match := _LAYER.search(name)) is not None:
            owners = [s for s, (start, end) in enumerate(stages) if start <= int(match.group(1)) < end]
        elif "embed_tokens" in name:
            owners = [0]
        elif name.startswith(("lm_head", "model.norm")):
            owners = [last]
        else:
            owners = list(range(len(stages)))
        size = tensor.numel() * tensor.element_size()
        for stage in owners:
            if (stage, id(tensor)) not in seen:  # one tensor twice on a stage (a tied head at pp=1): held once
                seen.add((stage, id(tensor)))
                out[stage] += -(-size // tp) if isinstance(tensor, nn.Parameter) and tensor.dim() >= 2 else size
    return out


def pool_bytes(cache: CacheConfig, block: int, swap: bool) -> int:
    """One rank's KV pool of ``block``-byte blocks as asked (num_kv_blocks, kv_cache_memory, or by default the
    least a worker accepts, 2 blocks: its default pool is a share of what is left), with its swap space."""
    if cache.num_kv_blocks is not None:
        kv = cache.num_kv_blocks * block
    elif cache.kv_cache_memory is not None:
        kv = cache.kv_cache_memory // block * block
    else:
        kv = 2 * block
    return kv + (int(cache.swap_space * GIB) // block * block if swap else 0)


def rank_bytes(config: EngineConfig, arch: ArchConfig, model: nn.Module, weights: WeightBytes,
               draft: ArchConfig | None = None, draft_weights: WeightBytes | None = None) -> list[RankBytes]:
    """Every rank's bytes, in rank order (stage x tensor_parallel_size + tensor-parallel rank). ``model``: the
    model built on the meta device at tp=1, pp=1; ``weights``: its weights as loading makes them
    (memory_fit.estimate_weight_bytes), shared out as the tensors are; a draft model's whole on every rank."""
    parallel, cache = config.parallel, config.cache
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    stages = layer_partition(arch.num_layers, pp, parallel.pp_layer_partition)
    raw = stage_tensor_bytes(model, stages, tp)
    whole = max(1, stage_tensor_bytes(model, [(0, arch.num_layers)], 1)[0])  # (the scale of loading's changes)
    kv_dtype = kv_quant.kv_cache_torch_dtype(cache.cache_dtype, getattr(torch, config.model.dtype))
    swap = config.scheduler.preemption_mode == "swap"
    extra = draft_weights or WeightBytes(0, 0)
    head = -(-weights.head_copy // tp) if pp == 1 else 0  # a tied head's packed copy: one worker's model only
    out = []
    for stage, (start, end) in enumerate(stages):
        for tp_rank in range(tp):
            heads = shard_heads(arch.num_heads, arch.num_kv_heads, tp, tp_rank).num_kv_heads
            block = kv_block_bytes(arch, heads, cache.block_size, kv_dtype, draft, end - start)
            out.append(RankBytes(stage, tp_rank, (start, end), raw[stage] * weights.loading // whole + extra.loading,
                                 raw[stage] * (weights.final - weights.head_copy) // whole + head + extra.final,
                                 0 if config.model.encoder_only else pool_bytes(cache, block, swap)))
    return out


def check_ranks(config: EngineConfig, ranks: list[RankBytes], limit: int, suggest: int | None = None) -> None:
    """Refuse ranks over worker_memory_limit, naming the largest one's figures and what would fit (``suggest``:
    the smallest pipeline_parallel_size whose ranks would, 0 where none would, None: not said)."""
    worst = max(ranks, key=lambda r: r.need)
    if worst.need <= limit:
        return
    parallel = config.parallel
    loading = f" ({size(worst.weights_loading)} while loading)" if worst.weights_loading > worst.weights else ""
    hint = "" if suggest is None else (
        f"; pipeline_parallel_size={suggest} splits the layers into stages whose ranks fit" if suggest else
        "; no pipeline_parallel_size makes every rank fit")
    raise ValidationError(
        f"a worker would hold more than worker_memory_limit={size(limit)}: "
        f"{worst.describe(parallel.pipeline_parallel_size, parallel.tensor_parallel_size)} needs "
        f"{size(worst.weights)} for its weights{loading} + {size(worst.kv)} for its KV cache = "
        f"{size(worst.need)}{hint}; a smaller KV cache (kv_cache_memory, num_kv_blocks) needs less",
        param="worker_memory_limit", value=limit)


def size(nbytes: int) -> str:
    """Bytes in words: GiB from 1 GiB up, else MiB."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.2f} MiB"


def machine_need(ranks: list[RankBytes]) -> tuple[int, int, int, int]:
    """(weights while loading, weights, KV, the most held) of ``ranks`` together: they load at once."""
    loading, weights, kv = (sum(getattr(r, f) for r in ranks) for f in ("weights_loading", "weights", "kv"))
    return loading, weights, kv, max(loading, weights + kv)
