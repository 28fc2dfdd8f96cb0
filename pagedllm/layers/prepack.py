"""Weights packed once after loading, for CPU matmuls.

``F.linear`` hands the BLAS a plain row-major weight, which it re-lays out into its blocked GEMM
format on every call; with few token rows (decode of a small batch) that re-layout costs as much
as the product. Packing once after loading skips it. Two packers, and one layout left plain:

- our GEMM (``pagedllm/csrc/gemm.cpp``, through layers/cpu_ops.py) for float32, bfloat16 and
  float16 weights wherever the kernels exist, except bf16 on AMX CPUs (oneDNN's AMX tiles are
  faster there). At AVX512-BF16 on 2 cores, all 30 layers of SmolLM2-135M with weights streamed
  from memory: 1 row 6.2 -> 4.2 ms, 16 rows 8.1 -> 6.7, 64 rows 19.5 -> 16.3, 256 rows 56.3 ->
  53.6, 2,048 rows 427 -> 418 against oneDNN's prepacked matmul.
- otherwise, for bf16 (on AMX CPUs the shapes the AMX GEMM below does not take, or every bf16 weight with
  ``PAGEDLLM_GEMM=onednn``), oneDNN's own packed layout
  (``_reorder_linear_weight``): against ``F.linear``, 1 row 1.89 -> 0.99 ms, 8 rows 2.27 -> 1.32,
  256 rows 17.8 -> 16.7 per layer set; bit-identical.
- at the "amx" level, bf16 weights whose shape AMX tiles take stay plain: steps of up to 32 rows run our AMX GEMM
  over them (``csrc/gemm_amx.cpp``: the weight streamed once, in order; 1.2-1.35x oneDNN's prepacked matmul at
  1-32 rows on 2 Xeon cores), more rows F.linear over the same weight (oneDNN packs per call: within 0-40% of the
  prepacked matmul at 32-256 rows, level with it from 1,024). No second copy of any weight.

Weights kept in GGUF formats run the quantized kernels (layers/quant.py); where PAGEDLLM_DENSE_COPY says so (by
default: small bf16 models at the "amx" level) they also get a dense copy in oneDNN's layout
(``add_dense_copies``) that steps of more than DENSE_ROWS rows run on.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm import platform
from pagedllm.layers.cpu_ops import AMX_GEMM_ROWS, CpuKernels, fused_ops
from pagedllm.layers.quant import DENSE_ROWS, QuantWeight, kept_weights, quant_linear, wants_dense


@dataclass(frozen=True)
class PackedWeight:
    """A weight packed for one of the two packers."""

    data: torch.Tensor
    """Our GEMM's 1-D packed copy, or oneDNN's opaque mkldnn tensor."""
    out_features: int
    kernels: CpuKernels | None
    """The kernels that packed it (their level's layout); None for oneDNN."""
    amx: bool = False
    """``data`` is the plain weight for AMX tiles at few rows and oneDNN's F.linear at more (``kernels`` run it)."""


@functools.lru_cache(maxsize=1)
def _onednn_available() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    try:
        return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
                and hasattr(mkldnn, "_linear_pointwise") and bool(mkldnn._is_mkldnn_bf16_supported()))
    except (AttributeError, RuntimeError):
        return False


def _own_gemm(weight: torch.Tensor) -> CpuKernels | None:
    """Our GEMM's kernels when they take this weight, else None."""
    ops = fused_ops(weight)
    if ops is None or not ops.gemm_suits(weight):
        return None
    if weight.dtype == torch.bfloat16 and _onednn_available() and platform.bf16_gemm() != "ours":
        return None  # AMX tiles (or an A/B run) for bf16
    return ops


def _amx_gemm(weight: torch.Tensor) -> CpuKernels | None:
    """The "amx" level's kernels for a bf16 weight whose shape their AMX GEMM takes (K a multiple of 32, N of 16),
    else None (also with PAGEDLLM_GEMM=onednn)."""
    ops = fused_ops(weight)
    if ops is None or not ops.amx or weight.dtype != torch.bfloat16 or platform.bf16_gemm() != "amx":
        return None
    return ops if amx_takes(*weight.shape) else None


def amx_takes(rows: int, cols: int) -> bool:
    """The AMX GEMM's shapes (csrc/gemm_amx.cpp): K a multiple of 32, N of 16."""
    return cols % 32 == 0 and rows % 16 == 0


def can_prepack(weight: torch.Tensor) -> bool:
    """True for a 2-D CPU weight one of the packers takes."""
    if not platform.is_cpu(weight.device) or weight.dim() != 2:
        return False
    return (_own_gemm(weight) is not None or _amx_gemm(weight) is not None
            or (weight.dtype == torch.bfloat16 and _onednn_available()))


def prepack(weight: torch.Tensor) -> PackedWeight:
    """The (out, in) weight packed for our GEMM, or for oneDNN."""
    weight = weight.detach().contiguous()
    ops = _own_gemm(weight)
    if ops is not None:
        return PackedWeight(ops.gemm_pack(weight), weight.shape[0], ops)
    ops = _amx_gemm(weight)
    if ops is not None:  # kept as it is: AMX tiles read it plain (no second copy)
        return PackedWeight(weight, weight.shape[0], ops, amx=True)
    return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight), weight.shape[0], None)


def silu_pack(gate_up: torch.Tensor) -> PackedWeight | None:
    """A [gate; up] weight (2 * features, in) packed so that our GEMM's epilogue writes
    silu(gate) * up (no (tokens, 2 * features) array, no separate SiLU pass); None where our
    GEMM does not take it or the features do not fill its gate/up groups."""
    ops = _own_gemm(gate_up)
    if ops is None:
        return None
    group = ops.gemm_layout(gate_up.dtype).silu_group
    features = gate_up.shape[0] // 2
    if features % group:
        return None
    return PackedWeight(_pack_in_order(ops, gate_up.detach(), silu_interleave(features, group)), gate_up.shape[0],
                        ops)


_PACK_SLICE_BYTES = 2 * 1024**2
"""Bytes of reordered rows gathered at a time by ``_pack_in_order``."""


def _pack_in_order(ops: CpuKernels, weight: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``ops.gemm_pack(weight[order])`` without the reordered copy of the whole weight (SmolLM2-1.7B's gate_up:
    64 MiB beside the weight and its packed copy while loading): the packed layout is one run of ``block``
    outputs after another, so slices of whole blocks pack on their own, each gathered just before."""
    rows, cols = weight.shape
    block = ops.gemm_layout(weight.dtype).block
    step = max(1, _PACK_SLICE_BYTES // (cols * weight.element_size() * block)) * block  # whole blocks
    out = torch.empty(rows * cols, dtype=weight.dtype)  # (rows * cols,): the packed copy
    for start in range(0, rows, step):
        part = order[start:start + step]
        out[start * cols:(start + len(part)) * cols] = ops.gemm_pack(weight[part])  # (len(part) * cols,)
    return out


def silu_interleave(features: int, group: int) -> torch.Tensor:
    """Row order of a packed [gate; up] weight (2 * features, in) for the GEMM's fused SiLU:
    ``group`` gate rows, then the ``group`` matching up rows, and so on."""
    assert features % group == 0
    gate = torch.arange(features).view(-1, group)  # (features / group, group)
    return torch.cat([gate, gate + features], dim=1).reshape(-1)  # (2 * features,)


def silu_and_mul_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T) through a weight packed by ``silu_pack`` (bias in its order)."""
    assert packed.kernels is not None
    return packed.kernels.gemm(x, packed.data, packed.out_features, bias, True)


Matmul = Callable[..., torch.Tensor]
"""(x, bias=None) -> x W^T + b, for one weight as it was prepared at load."""


def matmul_for(packed: PackedWeight | None, quant: QuantWeight | None) -> Matmul | None:
    """A weight's matmul, chosen once when the model loads: the quantized kernels for rows kept quantized, our
    GEMM or oneDNN's for a packed weight; None for a plain weight (``F.linear`` over the layer's own)."""
    if quant is not None:
        return functools.partial(_quantized, quant)
    if packed is None:
        return None
    if packed.amx:
        return functools.partial(_amx, packed.kernels, packed.data)
    if packed.kernels is not None:
        return functools.partial(_ours, packed.kernels.gemm, packed.data, packed.out_features)
    return functools.partial(_onednn, packed.data)


def on_onednn(packed: PackedWeight | None, quant: QuantWeight | None) -> bool:
    """Whether ``matmul_for`` gives this weight oneDNN's matmul."""
    return quant is None and packed is not None and (packed.kernels is None or packed.amx)


def rows_for(packed: PackedWeight | None, quant: QuantWeight | None) -> Callable[[int], int]:
    """rows -> the row count a weight's matmul (``matmul_for``'s choice) computes for them: ``onednn_rows`` for
    oneDNN's, the same count otherwise. A caller that hands oneDNN that many rows saves the padding copy."""
    return onednn_rows if on_onednn(packed, quant) else _same_rows


def _same_rows(rows: int) -> int:
    return rows


def _quantized(quant: QuantWeight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The quantized kernels, or for a step of more than DENSE_ROWS rows the weight's dense copy where it has one
    (``add_dense_copies``: there oneDNN's AMX tiles beat the int8 dot products)."""
    dense = quant.dense
    if dense is not None and x.numel() > DENSE_ROWS * x.shape[-1] and x.dtype == dense.dtype:
        return (_onednn if dense.is_mkldnn else _plain_linear)(dense, x, bias)
    return quant_linear(x, quant, bias)


_DENSE_SLICE_ROWS = 4096
"""Rows dequantized at a time by ``add_dense_copies`` (bounds its temporaries)."""


def _decoded(quant: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """A kept weight decoded whole by the kernels' own decoder, a slice of rows at a time: (rows, cols)."""
    kernels = quant.kernels
    assert kernels is not None
    dense = torch.empty(quant.rows, quant.cols, dtype=dtype)  # (rows, cols)
    for offset, piece in quant.pieces.items():
        for start in range(0, piece.rows, _DENSE_SLICE_ROWS):
            ids = torch.arange(start, min(piece.rows, start + _DENSE_SLICE_ROWS))
            dense[offset + start:offset + start + len(ids)] = kernels.qrows(piece, ids, dtype)
    return dense


def add_dense_copies(model: torch.nn.Module, dtype: torch.dtype, quantization: str | None, room: int = 0) -> int:
    """After the weights are processed: beside every weight kept quantized, a dense copy where ``wants_dense`` says
    so (``room``: the bytes free once the weights and KV pool are in), in oneDNN's packed layout for bf16 where
    oneDNN runs, else plain, decoded by the kernels' own decoder (the values the quantized kernels read). Returns
    the bytes of the copies (0: none made)."""
    weights = kept_weights(model)
    nbytes = sum(q.rows * q.cols for q in weights) * dtype.itemsize
    if not weights or not wants_dense(any(q.kernels is not None and q.kernels.amx for q in weights), dtype,
                                      quantization, nbytes, room):
        return 0
    for quant in weights:
        dense = _decoded(quant, dtype)
        packed = dtype == torch.bfloat16 and _onednn_available()  # 1.2-1.6x F.linear at 48-128 rows (plain)
        quant.dense = torch.ops.mkldnn._reorder_linear_weight(dense) if packed else dense
    return nbytes


def _ours(gemm: Callable[..., torch.Tensor], data: torch.Tensor, out_features: int, x: torch.Tensor,
          bias: torch.Tensor | None = None) -> torch.Tensor:
    return gemm(x, data, out_features, bias, False)


def onednn_rows(rows: int) -> int:
    """The row count oneDNN is given for ``rows`` token rows: exact up to 32, else rounded up to a multiple of 32
    (of 64 above 512, of 256 above 4,096). oneDNN builds (JITs) a primitive per new shape, ~6 ms each against
    ~1 ms for the product (2,000 x 384 x 1,536 bf16 on AMX), and keeps 1,024 of them: prompt and encoder steps,
    whose row counts vary from step to step, ran 10-20% slower until every count had been seen (all-MiniLM,
    10,000 sentences, tcmalloc: 927 / 1,035 / 1,110 sentences/s in three rounds against 1,024 / 1,032 / 1,012
    rounded), and a server's mix of counts would never get there. Rounding bounds the shapes at ~110 per weight
    (at most 1.5% padding rows at 2,048)."""
    if rows <= 32:
        return rows
    step = 32 if rows <= 512 else 64 if rows <= 4096 else 256
    return -(-rows // step) * step


def _amx(ops: CpuKernels, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Up to AMX_GEMM_ROWS rows on AMX tiles over the plain weight (a decode step: the weight streamed once, in
    order; 1.2-1.35x oneDNN's prepacked matmul at 1-32 rows on 2 Xeon cores), more through F.linear (oneDNN,
    the row count rounded as ``onednn_rows`` rounds it)."""
    rows = x.numel() // x.shape[-1]
    if not 0 < rows <= AMX_GEMM_ROWS:
        return _plain_linear(weight, x, bias)
    x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()  # (rows, in)
    out = torch.empty(rows, weight.shape[0], dtype=x2.dtype)  # (rows, out)
    ops.amx_gemm(x2, weight, out)
    if bias is not None:
        out += bias
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])  # (..., out)


def _plain_linear(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b by F.linear over the plain weight (oneDNN packs it per call), rows rounded as ``_onednn`` rounds
    them."""
    return _rounded(x, lambda x2: torch.nn.functional.linear(x2, weight, bias))


def _onednn(data: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _rounded(x, lambda x2: torch.ops.mkldnn._linear_pointwise(x2, data, bias, "none", [], ""))


def _rounded(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``product`` of x's rows, handed to oneDNN as ``onednn_rows`` of them (a cached shape)."""
    x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()  # (rows, in)
    rows = x2.shape[0]
    padded = onednn_rows(rows)
    if padded != rows:  # zero rows to a cached shape; their outputs are dropped (each row's product is its own)
        x2 = torch.nn.functional.pad(x2, (0, 0, 0, padded - rows))
    out = product(x2)[:rows]
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])  # (..., out)
