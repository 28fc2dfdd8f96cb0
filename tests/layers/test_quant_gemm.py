"""The quantized GEMM / GEMV (pagedllm/csrc/quant.cpp) at every kernel level this CPU runs, for each
GGUF format it keeps (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), against the gguf package's reference
decoder, as the file has them and packed at load where the level packs the format (Q8_0, Q4_0, Q4_1 in
quant.cpp; Q4_K, Q5_K, Q6_K in quant_k.cpp).

Weights are random blocks (random bytes, the f16 scale fields set to sane values): every bit
pattern of the quantized values is as likely as in a real file. Two references: the exact one —
x quantized to int8 per 32 values as the kernel does it (scale amax / 127, round to nearest even),
times the dequantized weight, in float64 — which the kernel meets to float32 summation error; and
the plain float product, which it meets within the activations' quantization error. Shapes
cover the 4-row register tiles and their 1-3 row remainders, 1-4 feature remainders, several
units of 16 features and 64 rows.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.layers.quant import _BLOCKS, GGML_TYPES, QuantTensor, QuantWeight

# byte offsets of each format's f16 scale fields within a block (d; and m / dmin)
_SCALE_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
                 "Q5_K": (0, 2), "Q6_K": (208,)}


def random_quant(name: str, rows: int, cols: int, seed: int = 0) -> QuantTensor:
    """A (rows, cols) matrix of random blocks of format ``name``."""
    qtype = GGML_TYPES[name]
    block, nbytes = _BLOCKS[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    for offset in _SCALE_FIELDS[name]:  # scales of either sign, around 1 / 64 (Q4_K's mins too)
        scales = (rng.uniform(0.5, 1.5, size=data.shape[:2]) * rng.choice([-1, 1], size=data.shape[:2]) / 64)
        data[:, :, offset:offset + 2] = scales.astype(np.float16).view(np.uint8).reshape(*data.shape[:2], 2)
    return QuantTensor(qtype, rows, cols, torch.from_numpy(data.reshape(rows, -1)))


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: per 32 values, int8 round(x / d) * d with d = amax / 127 (float64)."""
    chunks = x.double().view(x.shape[0], -1, 32)  # (rows, chunks, 32)
    d = chunks.abs().amax(-1, keepdim=True).float().double() / 127  # float32 scale, as the kernel's
    q = torch.where(d > 0, torch.round((chunks.float() * (1 / d.float())).double()), torch.zeros_like(chunks))
    return (q * d).view_as(x)


FORMATS = sorted(GGML_TYPES)


PACKED = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
"""The formats the kernels pack at load (the others run as the file has them)."""


def layouts(kernels, w: QuantTensor) -> list[QuantTensor]:
    """W as the file has it, and packed where the kernels pack its format."""
    packed = kernels.qpack(w)
    assert packed.packed == (w.type_name in PACKED)
    return [w, packed] if packed.packed else [w]


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 5, 70])
@pytest.mark.parametrize("out_features,in_features", [(37, 512), (16, 256), (3, 768)])
def test_quant_gemm_matches_dequantized_product(kernels, name: str, rows: int, out_features: int,
                                                in_features: int) -> None:
    raw = random_quant(name, out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    for w in layouts(kernels, raw):
        out = torch.empty(rows, out_features)
        kernels.qgemm(x, w, out)
        check_product(out, x, raw)


def check_product(out: torch.Tensor, x: torch.Tensor, w: QuantTensor) -> None:
    dense = w.dequantize().double()
    exact = quantized_activations(x) @ dense.t()
    plain = x.double() @ dense.t()
    scale = plain.abs().max()
    assert ((out.double() - exact).abs() <= 1e-5 * scale).all()
    # int8 activations: each product off by up to half a step of its chunk; summed, ~1% of the result's scale
    assert ((out.double() - plain).abs() <= 0.03 * scale).all()


# the fields of a K-quant super-block set to their largest values: (byte offset, length, value)
_K_EXTREMES = {"Q4_K": [(4, 140, 0xFF)],  # 6-bit scales and mins 63, q 15
               "Q5_K": [(4, 172, 0xFF)],  # q 31
               "Q6_K": [(0, 192, 0xFF), (192, 16, 0x7F)]}  # q 63 (value 31 after the zero point), scales 127


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_packed_k_quants_sum_the_largest_values_without_overflow(kernels, name: str) -> None:
    """Every weight at its format's largest q against activations of +-127 after quantization (constant rows):
    the int16 pair sums the kernels add up below VNNI stay under 2^15, Q6_K's zero point (32 x the sum of 16
    activations) included; in 70 features (groups of 8 or 16 and a partial one) and 5 rows (a 4-row tile and one)."""
    raw = random_quant(name, 70, 512)
    data = raw.data.clone().view(70, 2, -1)  # (rows, super-blocks, bytes)
    for offset, length, value in _K_EXTREMES[name]:
        data[:, :, offset:offset + length] = value
    big = QuantTensor(raw.qtype, 70, 512, data.reshape(70, -1))
    x = torch.ones(5, 512)
    x[1] = -1
    x[3, ::2] = -1
    packed = kernels.qpack(big)
    assert packed.packed
    out = torch.empty(5, 70)
    kernels.qgemm(x, packed, out)
    check_product(out, x, big)


def test_q8_0_scales_beyond_the_packed_offset_run_unpacked(kernels) -> None:
    """Where VNNI packs Q8_0 unsigned (offset -128 d in f16), a scale over 511 cannot be packed: the matrix stays
    as the file has it and still multiplies right; levels that pack Q8_0 signed take it."""
    raw = random_quant("Q8_0", 16, 256)
    data = raw.data.clone().view(16, 8, 34)  # (rows, blocks, bytes)
    data[3, 5, :2] = torch.tensor([1000.0], dtype=torch.float16).view(torch.uint8)
    big = QuantTensor(raw.qtype, 16, 256, data.reshape(16, -1))
    w = kernels.qpack(big)
    assert w.packed == (kernels.level != "avx512_bf16")  # the level built with VNNI (platform/build.py)
    x = torch.randn(5, 256)
    out = torch.empty(5, 16)
    kernels.qgemm(x, w, out)
    check_product(out, x, big)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quant_gemm_reads_and_writes_16_bit_storage(kernels, name: str, dtype: torch.dtype) -> None:
    """bf16 / f16 activations in, the same storage out (float32 sums, one rounding at the end), into a
    column slice of a wider output (row stride != width), from strided input rows."""
    quant = random_quant(name, 48, 512)
    wide = torch.randn(9, 600).to(dtype)
    x = wide[:, :512]  # rows 600 apart
    for w in layouts(kernels, quant):
        out = torch.full((9, 80), 7.0, dtype=dtype)
        kernels.qgemm(x, w, out[:, 16:64])
        want = torch.empty(9, 48)
        kernels.qgemm(x.float(), w, want)
        assert torch.equal(out[:, 16:64], want.to(dtype))
        assert (out[:, :16] == 7).all() and (out[:, 64:] == 7).all()


@pytest.mark.parametrize("name", FORMATS)
def test_quant_rows_equal_the_reference_decoder(kernels, name: str) -> None:
    raw = random_quant(name, 50, 512)
    ids = torch.tensor([3, 0, 49, 3, 17])
    for w in layouts(kernels, raw):
        got = kernels.qrows(w, ids, torch.float32)
        assert torch.allclose(got, raw.dequantize()[ids], rtol=1e-6, atol=1e-7)
        with pytest.raises(RuntimeError, match="row 50 outside"):
            kernels.qrows(w, torch.tensor([50]), torch.float32)


def test_quant_gemm_refuses_a_width_off_the_block(kernels) -> None:
    w = random_quant("Q4_K", 16, 256)
    bad = QuantTensor(w.qtype, 16, 128, w.data[:, :72].contiguous())
    with pytest.raises(RuntimeError, match="multiple of the format's block of 256"):
        kernels.qgemm(torch.randn(2, 128), bad, torch.empty(2, 16))


def test_mixed_formats_and_tensor_parallel_slices() -> None:
    """A q|k|v weight of two formats keeps one segment per format; a column slice inside a block comes
    back dequantized, one on block edges stays quantized."""
    q, k, v = random_quant("Q4_K", 32, 512), random_quant("Q4_K", 16, 512, 1), random_quant("Q6_K", 16, 512, 2)
    weight = QuantWeight(64, 512)
    for offset, piece in ((32, k), (0, q), (48, v)):
        weight.place(offset, piece)
    assert weight.complete()
    segments = weight.segments()
    assert [(o, s.type_name, s.rows) for o, s in segments] == [(0, "Q4_K", 48), (48, "Q6_K", 16)]
    assert torch.equal(segments[0][1].dequantize(), torch.cat([q.dequantize(), k.dequantize()]))
    rows = q.narrow(0, 8, 16)  # a rank's rows: their own storage, not a view that keeps the whole file's tensor
    assert rows.data.untyped_storage().nbytes() == rows.data.numel() and torch.equal(rows.data, q.data[8:24])
    kept = q.narrow(1, 256, 256)
    assert isinstance(kept, QuantTensor) and torch.equal(kept.dequantize(), q.dequantize()[:, 256:])
    cut = q.narrow(1, 128, 256)
    assert isinstance(cut, torch.Tensor) and torch.equal(cut, q.dequantize()[:, 128:384])


@pytest.mark.parametrize("name,cols", [("Q4_1", 64), ("Q6_K", 256)])
def test_a_packed_weight_runs_only_on_the_level_that_packed_it(name: str, cols: int) -> None:
    """The packed layout is the level's (8-row groups below AVX-512, 16 with it): another level refuses it."""
    from pagedllm.layers import cpu_ops
    from tests.utils import kernel_levels

    levels = kernel_levels()
    if len(levels) < 2:
        pytest.skip("one kernel level here")
    with cpu_ops.use_level(levels[-1]):
        packed = cpu_ops.active().qpack(random_quant(name, 16, cols))
    with cpu_ops.use_level(levels[0]):
        with pytest.raises(RuntimeError, match=f"packed by the {levels[-1]} kernels"):
            cpu_ops.active().qgemm(torch.randn(1, cols), packed, torch.empty(1, 16))
