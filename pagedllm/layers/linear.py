"""Linear layers that split their weight across tensor-parallel ranks.

Column-parallel layers split the output features (no communication); row-parallel layers
split the input features and sum the partial products with an all-reduce. Packed layers
(QKV, gate_up) load each checkpoint shard into its slice through ``weight_loader``. A dimension
that does not divide by the number of ranks splits unevenly (``split_evenly``; attention along
GQA groups, ``shard_heads``): SmolLM2-135M's 9 heads / 3 KV heads run on 2 ranks as 6 + 3.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.ops import tensor_model_parallel_all_reduce
from pagedllm.distributed.parallel_state import get_tp_rank, get_tp_world_size, shard_heads, split_evenly
from pagedllm.layers.prepack import (
    PackedWeight,
    can_prepack,
    matmul_for,
    on_onednn,
    prepack,
    rows_for,
    silu_and_mul_linear,
    silu_interleave,
    silu_pack,
)
from pagedllm.layers.quant import QuantWeight, kept_quantized, store_rows, will_quantize


def _param(*shape: int, dtype: torch.dtype | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _weight(*shape: int, dtype: torch.dtype | None) -> nn.Parameter:
    """A layer's (out, in) weight: it may also take a GGUF file's quantized rows (layers/quant.py)."""
    param = _param(*shape, dtype=dtype)
    param.takes_quantized = True
    return param


class _PrepackedLinear(nn.Module):
    """Holds ``weight`` (out, in); after loading, a CPU weight is replaced by a packed copy."""

    weight: nn.Parameter
    packed_weight: PackedWeight | None = None
    quant: QuantWeight | None = None
    """The weight's rows kept in their GGUF formats (quantization="gguf" where the kernels run), else None."""
    lora: Any = None
    """With enable_lora: the layer's LoRA slots (lora/layers.py LoRALinear), whose ``apply`` adds the step's
    adapter deltas to the output; None otherwise."""

    def lora_shape(self) -> tuple[int, list[int]]:
        """(input features, output rows of each packed projection) of this rank's weight: a LoRA slot's shape."""
        return self.weight.shape[1], [self.weight.shape[0]]

    def _with_lora(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out if self.lora is None or self.lora.step.mask is None else self.lora.apply(x, out)

    def process_weights_after_loading(self) -> None:
        """Keep quantized rows for the quantized kernels, or pack the loaded weight for our GEMM or oneDNN
        (layers/prepack.py); either replaces the plain copy."""
        self.quant = kept_quantized(self.weight)
        if self.quant is None and can_prepack(self.weight):
            self.packed_weight = prepack(self.weight)
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)  # the packed copy replaces it
        matmul = matmul_for(self.packed_weight, self.quant)
        if matmul is not None:  # bound once: forward asks nothing about the weight's form
            self._matmul = matmul
        self.rows_for = rows_for(self.packed_weight, self.quant)

    def rows_for(self, rows: int) -> int:
        """The row count this layer's matmul computes for ``rows`` input rows (more where oneDNN pads them to a
        cached shape: layers/prepack.py ``onednn_rows``); bound at load like the matmul."""
        return rows

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T + b over the plain weight (what a weight kept quantized or packed at load replaces)."""
        return F.linear(x, self.weight, bias)


class ColumnParallelLinear(_PrepackedLinear):
    """y = x W^T + b with W split by rows (output features) across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 dtype: torch.dtype | None = None, partition: tuple[int, int] | None = None) -> None:
        """``partition``: (first row, rows) of this rank; default: an even split of output_size."""
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        self.input_size = input_size
        self.output_start, self.output_size_per_partition = (
            partition if partition is not None else split_evenly(output_size, self.tp_size, self.tp_rank))
        self.weight = _weight(self.output_size_per_partition, input_size, dtype=dtype)
        self.weight.weight_loader = self.weight_loader
        self.bias = _param(self.output_size_per_partition, dtype=dtype) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """Copy this rank's rows of a full checkpoint tensor."""
        store_rows(param, loaded.narrow(0, self.output_start, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._with_lora(x, self._matmul(x, self.bias))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (e.g. gate_up)."""

    silu_packed: PackedWeight | None = None
    """[gate; up] packed for the GEMM's fused silu(gate) * up (set by ``pack_for_silu_and_mul``)."""
    silu_bias: torch.Tensor | None = None
    """The bias in the same interleaved order."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        self.output_sizes = output_sizes
        # each projection splits on its own: this rank's slice of every one, back to back
        self.shards = [split_evenly(size, get_tp_world_size(), get_tp_rank()) for size in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, dtype, partition=(0, sum(n for _, n in self.shards)))

    def pack_for_silu_and_mul(self) -> None:
        """For a [gate, up] pair on a CPU where our GEMM runs: pack the rows interleaved so one
        GEMM writes silu(gate) * up (no (tokens, 2 * intermediate) array, no separate SiLU pass).
        Not with a LoRA layer (an adapter's delta must be added before the SiLU), nor quantized rows."""
        quantized = getattr(self.weight, "quant", None) is not None or will_quantize(self.weight)
        pair = len(self.output_sizes) == 2 and self.output_sizes[0] == self.output_sizes[1]
        if self.lora is not None or quantized or not pair or self.weight.dim() != 2:
            return
        packed = silu_pack(self.weight)
        if packed is None:
            return
        self.silu_packed = packed
        if self.bias is not None:
            group = packed.kernels.gemm_layout(self.weight.dtype).silu_group
            order = silu_interleave(self.output_size_per_partition // 2, group)
            self.silu_bias = self.bias.detach()[order].contiguous()
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)  # the packed copy replaces it

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(x W_gate^T) * (x W_up^T) in one GEMM when packed for it, else None."""
        if self.silu_packed is None:
            return None
        return silu_and_mul_linear(x, self.silu_packed, self.silu_bias)

    def lora_shape(self) -> tuple[int, list[int]]:
        return self.input_size, [n for _, n in self.shards]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """Copy this rank's rows of checkpoint shard ``shard_id`` (an index into output_sizes)."""
        assert isinstance(shard_id, int)
        start, size = self.shards[shard_id]
        offset = sum(n for _, n in self.shards[:shard_id])
        store_rows(param, loaded.narrow(0, start, size), offset)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections packed in one matmul; heads split across ranks along GQA groups."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, dtype: torch.dtype | None = None) -> None:
        self.head_dim = head_dim
        self.heads = shard_heads(num_heads, num_kv_heads, get_tp_world_size(), get_tp_rank())
        self.num_heads, self.num_kv_heads = self.heads.num_heads, self.heads.num_kv_heads
        rows = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias, dtype, partition=(0, rows))

    def lora_shape(self) -> tuple[int, list[int]]:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.input_size, [q, kv, kv]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """Copy this rank's heads of checkpoint shard "q", "k" or "v" (replicated KV heads: the same
        rows on several ranks)."""
        h, d = self.heads, self.head_dim
        q_size, kv_size = h.num_heads * d, h.num_kv_heads * d
        offset, start, size = {"q": (0, h.q_start * d, q_size), "k": (q_size, h.kv_start * d, kv_size),
                               "v": (q_size + kv_size, h.kv_start * d, kv_size)}[shard_id]
        store_rows(param, loaded.narrow(0, start, size), offset)


class RowParallelLinear(_PrepackedLinear):
    """y = x W^T + b with W split by columns (input features); partial sums all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 dtype: torch.dtype | None = None, partition: tuple[int, int] | None = None) -> None:
        """``partition``: (first column, columns) of this rank; default: an even split of input_size
        (the split of the column-parallel layer that feeds it)."""
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        self.input_start, self.input_size_per_partition = (
            partition if partition is not None else split_evenly(input_size, self.tp_size, self.tp_rank))
        self.weight = _weight(output_size, self.input_size_per_partition, dtype=dtype)
        self.weight.weight_loader = self.weight_loader
        self.bias = _param(output_size, dtype=dtype) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self._bias_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """Copy this rank's columns of a full checkpoint tensor (quantized rows: cut on block edges, else
        dequantized)."""
        store_rows(param, loaded.narrow(1, self.input_start, param.shape[1]))

    def _bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        param.data.copy_(loaded)

    def process_weights_after_loading(self) -> None:
        super().process_weights_after_loading()
        # one rank, oneDNN's product: the bias goes in its epilogue, not in a pass of its own over the output
        # (all-MiniLM, 3,000 sentences: 1,375 -> 1,439 sentences/s). Our GEMM keeps the separate add the compiled
        # decoder stack mirrors.
        self._bias_in_product = self.tp_size == 1 and on_onednn(self.packed_weight, self.quant)

    _bias_in_product = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._bias_in_product and self.lora is None:
            return self._matmul(x, self.bias)
        out = tensor_model_parallel_all_reduce(self._with_lora(x, self._matmul(x, None)))
        return out if self.bias is None else out + self.bias  # bias once, after the sum
