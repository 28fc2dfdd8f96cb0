"""Weights kept in GGUF's quantized formats (``quantization="gguf"``): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
Q5_K, Q6_K (a llama.cpp Q4_K_M file's mix: Q4_K, Q5_K and Q6_K, Q5_0 / Q5_1 / Q8_0 where a width is off 256).

The loader hands a layer's weight loader ``QuantTensor`` s (whole rows of quantized blocks, as the
file has them) instead of float tensors. A linear layer, the embedding table and the LM head
collect their rows (tensor-parallel slices and packed projections such as q|k|v included) in a
``QuantWeight`` on the parameter, and after loading either keep it, when the compiled kernels run
here (csrc/quant.cpp: int8 dot products on the quantized blocks), or dequantize it into the
parameter (the portable level, other devices), which is then packed as any float weight.
A tensor-parallel split of the input features that falls inside a quantization block, and every
other tensor (norms, biases), is dequantized at load.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm import platform
from pagedllm.layers.cpu_ops import CpuKernels, fused_ops

GGML_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
"""The formats kept quantized, by GGML's type numbers (csrc/quant.cpp's QType)."""
_BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 12: (256, 144), 13: (256, 176),
           14: (256, 210)}
"""GGML type -> (values per block, bytes per block)."""


@dataclass(frozen=True)
class QuantTensor:
    """A (rows, cols) matrix of one GGML format: ``data`` (rows, cols / block * bytes) uint8 as the file
    has it, or (``packed``) the kernels' packed copy of it (``CpuKernels.qpack``)."""

    qtype: int
    rows: int
    cols: int
    data: torch.Tensor
    packed: bool = False
    level: str | None = None
    """Packed: the kernel level whose layout it has (8-row groups below AVX-512, 16 with it)."""

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def type_name(self) -> str:
        return next(name for name, code in GGML_TYPES.items() if code == self.qtype)

    def narrow(self, dim: int, start: int, length: int) -> QuantTensor | torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, start + length); columns that cut a block come back
        dequantized (float32)."""
        assert not self.packed
        if dim == 0:  # a copy when it is a part: a rank must not keep the whole file's tensor alive
            rows = self.data.narrow(0, start, length)
            return QuantTensor(self.qtype, length, self.cols, rows if length == self.rows else rows.clone())
        block, nbytes = _BLOCKS[self.qtype]
        if start % block or length % block:
            return self.dequantize().narrow(1, start, length)
        return QuantTensor(self.qtype, self.rows, length,
                           self.data.narrow(1, start // block * nbytes, length // block * nbytes).contiguous())

    def dequantize(self) -> torch.Tensor:
        """(rows, cols) float32, by the gguf package's reference decoders."""
        assert not self.packed
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(self.data.numpy(), GGMLQuantizationType(self.qtype))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(self.rows, self.cols)


@dataclass
class QuantWeight:
    """A layer's (rows, cols) weight assembled from quantized pieces of rows, each at its row offset."""

    rows: int
    cols: int
    pieces: dict[int, QuantTensor] = field(default_factory=dict)
    ready: bool = False
    """The pieces are the kernels' segments (joined by format, packed): set once, after loading."""
    kernels: CpuKernels | None = None
    """The kernels that packed the pieces and run them (set with ``ready``: chosen once, at load)."""
    dense: torch.Tensor | None = None
    """The weight in the model's dtype beside the pieces, in oneDNN's packed layout where it runs (else plain, (rows,
    cols)): steps of more than DENSE_ROWS rows run on it (layers/prepack.py ``add_dense_copies``); None: none."""

    def place(self, offset: int, piece: QuantTensor) -> None:
        assert piece.cols == self.cols and 0 <= offset and offset + piece.rows <= self.rows, (offset, piece.shape)
        self.pieces[offset] = piece

    def complete(self) -> bool:
        covered = 0
        for offset in sorted(self.pieces):
            if offset != covered:
                return False
            covered += self.pieces[offset].rows
        return covered == self.rows

    def segments(self) -> list[tuple[int, QuantTensor]]:
        """(row offset, rows) in order, neighbours of one format joined (one kernel call each)."""
        out: list[tuple[int, QuantTensor]] = []
        for offset in sorted(self.pieces):
            piece = self.pieces[offset]
            if out and out[-1][1].qtype == piece.qtype:
                first, prev = out[-1]
                out[-1] = (first, QuantTensor(piece.qtype, prev.rows + piece.rows, self.cols,
                                              torch.cat([prev.data, piece.data])))
            else:
                out.append((offset, piece))
        return out

    def dequantize_into(self, param: torch.Tensor) -> None:
        for offset, piece in self.pieces.items():
            param.data.narrow(0, offset, piece.rows).copy_(piece.dequantize())


def store_rows(param: torch.nn.Parameter, loaded: torch.Tensor | QuantTensor, offset: int = 0) -> None:
    """Rows [offset, offset + loaded rows) of ``param`` from a float tensor (copied) or a quantized one
    (kept in the parameter's QuantWeight)."""
    if isinstance(loaded, QuantTensor):
        if getattr(param, "quant", None) is None:
            param.quant = QuantWeight(*param.shape)
        param.quant.place(offset, loaded)
    else:
        param.data.narrow(0, offset, loaded.shape[0]).copy_(loaded)


_int8_on_load = False
"""quantization="int8": the layers quantize their float weights as they are processed after loading."""


@contextlib.contextmanager
def int8_on_load(enabled: bool) -> Iterator[None]:
    """Inside (with ``enabled``): ``kept_quantized`` turns float weights into per-channel int8 rows."""
    global _int8_on_load
    before, _int8_on_load = _int8_on_load, enabled
    try:
        yield
    finally:
        _int8_on_load = before


def will_quantize(param: torch.nn.Parameter) -> bool:
    """True when ``kept_quantized`` will turn this float weight into int8 rows (quantization="int8")."""
    return (_int8_on_load and getattr(param, "quant", None) is None and getattr(param, "takes_quantized", False)
            and param.dim() == 2 and param.numel() > 0 and param.shape[1] % 32 == 0 and fused_ops(param) is not None)


_INT8_SLICE_BYTES = 8 * 1024**2
"""Float32 values of a weight quantized at a time by ``int8_rows``."""


def int8_rows(weight: torch.Tensor) -> QuantTensor:
    """(rows, cols) float -> int8 weights with one scale per row (per output channel: amax / 127, an f16), in
    Q8_0's block format (the same scale in every block of a row) so that the Q8_0 kernels run them. A slice of rows
    at a time: the whole weight's float32 temporaries were ~3x its float32 size (SmolLM2-1.7B's table: +1.1 GiB of
    peak RSS while loading)."""
    rows, cols = weight.shape
    out = torch.empty(rows, cols // 32 * 34, dtype=torch.uint8)  # (rows, Q8_0 bytes of a row)
    step = max(1, _INT8_SLICE_BYTES // (4 * cols))
    for start in range(0, rows, step):
        out[start:start + step] = _int8_slice(weight[start:start + step])
    return QuantTensor(GGML_TYPES["Q8_0"], rows, cols, out)


def _int8_slice(weight: torch.Tensor) -> torch.Tensor:
    """(rows, cols) float -> (rows, cols / 32 * 34) uint8: Q8_0 blocks, every block of a row with the row's scale."""
    w = weight.detach().float()
    rows, cols = w.shape
    scale = (w.abs().amax(1) / 127).to(torch.float16)  # (rows,)
    inv = torch.where(scale > 0, 1 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
    q = torch.round(w * inv[:, None]).clamp(-127, 127).to(torch.int8)  # (rows, cols)
    blocks = q.view(torch.uint8).view(rows, cols // 32, 32)  # (rows, blocks, 32)
    d = scale.view(torch.uint8).view(rows, 1, 2).expand(rows, cols // 32, 2)  # (rows, blocks, 2)
    return torch.cat([d, blocks], dim=2).reshape(rows, -1)  # (rows, blocks * 34)


def kept_quantized(param: torch.nn.Parameter) -> QuantWeight | None:
    """After loading: the parameter's QuantWeight when the kernels run it here; otherwise it is
    dequantized into the parameter now (and None). With quantization="int8", a float weight the kernels
    take becomes per-channel int8 rows first."""
    if will_quantize(param):
        param.quant = QuantWeight(*param.shape)
        param.quant.place(0, int8_rows(param))
    quant = getattr(param, "quant", None)
    if quant is None:
        return None
    kernels = fused_ops(param)
    if quant.ready or (kernels is not None and quant.complete()):
        if not quant.ready:  # once: a tied embedding and LM head share the parameter
            quant.pieces = {offset: kernels.qpack(seg) for offset, seg in quant.segments()}
            quant.ready, quant.kernels = True, kernels
        param.data = torch.empty(0, dtype=param.dtype)  # the quantized rows replace it
        return quant
    quant.dequantize_into(param)
    param.quant = None
    return None


DENSE_ROWS = 48
"""Steps of more rows than this run a weight kept quantized on its dense copy, when it has one. On an AMX Xeon
(2 cores, bf16, SmolLM2-135M's shapes in Q4_1 against oneDNN's packed bf16 on AMX tiles, weights from memory:
benchmarks/quant_kernels.py --dense) the quantized kernels win up to 32 rows (they read 6x fewer bytes), level at
48, and lose from 64 (1.4-2x slower: their int8 dot products are compute, the tiles' products 16 rows at once)."""
DENSE_AUTO_BYTES = 1 << 30
"""PAGEDLLM_DENSE_COPY=auto makes dense copies while they take at most this (small models: the copy costs little),
or more where the machine has room for them (DENSE_AUTO_SHARE)."""
DENSE_AUTO_SHARE = 0.5
"""... or while they take at most this share of the memory left once the weights and the KV pool are in (``room``):
a 1.7B-shaped Q4_K_M model on an AMX Xeon prefilled a 4,096-token prompt in 11.0 s on its 3.4 GB bf16 copy against
35.7 s on the int8 dot products, and made 160 against 126 tok/s at 32 prompts (docs/BENCHMARKS.md, fifth run); an
8B model's 16 GB copy does not fit beside its KV pool on a 24 GB machine and is not made there."""


def wants_dense(amx: bool, dtype: torch.dtype, quantization: str | None, nbytes: int, room: int = 0) -> bool:
    """Whether weights kept quantized get dense copies (``nbytes`` in all) under PAGEDLLM_DENSE_COPY: "1" always,
    "0" never, "auto" where the kernels run AMX tiles (``amx``: the amx level) for a bf16 GGUF model whose copies
    take at most DENSE_AUTO_BYTES or DENSE_AUTO_SHARE of ``room`` (the bytes free once the weights and KV pool are
    in: dense_copy_room) (there AMX tiles beat the int8 dot products once a step has more than DENSE_ROWS rows;
    without them, the quantized kernels win every step: docs/BENCHMARKS.md)."""
    mode = platform.switches().dense_copy
    if mode != "auto":
        return mode == "1"
    return amx and dtype == torch.bfloat16 and quantization == "gguf" and (
        nbytes <= DENSE_AUTO_BYTES or nbytes <= room * DENSE_AUTO_SHARE)


def kept_weights(model: torch.nn.Module) -> list[QuantWeight]:
    """The model's weights kept quantized, each once (a tied embedding and LM head share one)."""
    found: dict[int, QuantWeight] = {}
    for module in model.modules():
        quant = getattr(module, "quant", None)
        if isinstance(quant, QuantWeight) and quant.ready:
            found.setdefault(id(quant), quant)
    return list(found.values())


def quant_linear(x: torch.Tensor, quant: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., cols) W^T + b -> (..., rows), each segment of W's rows by its format's kernel (the ones that
    packed it at load)."""
    kernels = quant.kernels
    assert kernels is not None, "kept quantized only where the kernels run (kept_quantized)"
    x2 = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, x.shape[-1]).contiguous()  # (tokens, cols)
    out = torch.empty(x2.shape[0], quant.rows, dtype=x.dtype)  # (tokens, rows)
    for offset, seg in quant.pieces.items():
        kernels.qgemm(x2, seg, out[:, offset:offset + seg.rows])
    if bias is not None:
        out += bias
    return out if x.dim() == 2 else out.view(*x.shape[:-1], quant.rows)  # (..., rows)


def _quantized_sizes(model: torch.nn.Module) -> tuple[dict[str, int], dict[str, int]]:
    """Matrices kept in each GGUF format, and bytes per format (and per dtype of their dense copies)."""
    count: dict[str, int] = {}
    size: dict[str, int] = {}
    seen: set[int] = set()
    for module in model.modules():
        quant = getattr(module, "quant", None)
        if not isinstance(quant, QuantWeight) or id(quant) in seen:
            continue
        seen.add(id(quant))  # a tied embedding and LM head: once
        for piece in quant.pieces.values():
            count[piece.type_name] = count.get(piece.type_name, 0) + 1
            size[piece.type_name] = size.get(piece.type_name, 0) + piece.data.numel()
        if quant.dense is not None:
            dense = f"{quant.dense.dtype}".removeprefix("torch.")
            size[dense] = size.get(dense, 0) + quant.dense.numel() * quant.dense.element_size()
    return count, size


def describe_quantized(model: torch.nn.Module) -> str:
    """One line: how many matrices (and bytes) the model keeps in each GGUF format."""
    count, size = _quantized_sizes(model)
    if not count:
        return ("no weight kept quantized (no compiled kernels at this level, or no matrix in a kept format): "
                "every weight dequantized")
    copies = [t for t in size if t not in count]
    return ", ".join(f"{count[t]} matrices in {t} ({size[t] / 2 ** 20:.1f} MiB)" for t in sorted(count)) + \
        "".join(f"; a {t} copy of them ({size[t] / 2 ** 20:.1f} MiB) for steps of more than {DENSE_ROWS} rows"
                for t in copies) + "; the other tensors dequantized"
