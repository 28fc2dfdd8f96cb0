"""The compiled GEMM (pagedllm/csrc/gemm.cpp) at every kernel level this CPU runs, for float32,
bfloat16 and float16 weights, against a float32 product rounded to the storage dtype.

Sums are float32 in both; only their order differs, so each output may be one rounding step of
the storage dtype away from the reference, never more. Shapes cover every register-tile row
remainder (rows mod 6, 1-2 row tiles), partial and full packed blocks, odd in_features, strided
input rows and bias; the `kernels` fixture forces each level in turn.
"""
from __future__ import annotations

import pytest
import torch

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.linear import MergedColumnParallelLinear

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
STEP = {torch.float32: 2 ** -20, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}  # one rounding step (relative)


def _check(kernels, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    out = kernels.gemm(x, kernels.gemm_pack(w), w.shape[0], bias, False)
    ref = x.float() @ w.float().t() + (bias.float() if bias is not None else 0)
    expected = ref.to(x.dtype).float()
    assert out.shape == (x.shape[0], w.shape[0]) and out.dtype == x.dtype
    # plus what float32 sums in another order can differ by where terms cancel
    tol = expected.abs() * STEP[x.dtype] + 1e-5 * ref.abs().max()
    assert ((out.float() - expected).abs() <= tol).all()
    if x.dtype != torch.float32:
        assert (out.float() == expected).float().mean() > 0.9


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 300])
@pytest.mark.parametrize("out_features,in_features", [(64, 576), (80, 98), (112, 2), (48, 1536), (16, 64),
                                                      (176, 33)])
def test_gemm_matches_float32_reference(kernels, dtype: torch.dtype, rows: int, out_features: int,
                                        in_features: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    w = (torch.randn(out_features, in_features, generator=g) * 0.1).to(dtype)
    if not kernels.gemm_suits(w):
        assert in_features % 2 and kernels.gemm_layout(dtype).even_k  # only vdpbf16ps needs pairs
        pytest.skip(f"{kernels.level} packs {dtype} weights in pairs along K (vdpbf16ps): odd in_features "
                    f"{in_features} is not ours to run (prepack leaves it to oneDNN or torch)")
    _check(kernels, x, w, None)
    _check(kernels, x, w, torch.randn(out_features, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_reads_strided_rows_and_many_chunks(kernels, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(700, 3, 96, generator=g).to(dtype)
    _check(kernels, wide[:, 1], (torch.randn(960, 96, generator=g) * 0.1).to(dtype), None)  # row stride 288


def test_gemm_refuses_shapes_it_cannot_pack(kernels) -> None:
    lanes = kernels.gemm_layout(torch.float32).lanes
    weight = torch.zeros(lanes + 4, 64)
    assert not kernels.gemm_suits(weight)
    with pytest.raises(RuntimeError, match="multiple of"):
        kernels.gemm_pack(weight)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_with_fused_silu_equals_gemm_then_silu(kernels, dtype: torch.dtype, bias: bool) -> None:
    g = torch.Generator().manual_seed(11)
    fused, plain = (MergedColumnParallelLinear(96, [160, 160], bias=bias, dtype=dtype) for _ in range(2))
    weight = (torch.randn(320, 96, generator=g) * 0.2).to(dtype)
    bias_values = torch.randn(320, generator=g).to(dtype)
    for layer in (fused, plain):
        layer.weight.data.copy_(weight)
        if bias:
            layer.bias.data.copy_(bias_values)
    fused.pack_for_silu_and_mul()
    plain.process_weights_after_loading()
    assert fused.silu_packed is not None and fused.silu_packed.kernels is kernels
    assert plain.packed_weight is not None and plain.silu_and_mul(torch.zeros(1, 96, dtype=dtype)) is None
    for rows in (1, 7, 300):
        x = torch.randn(rows, 96, generator=g).to(dtype)
        assert torch.equal(fused.silu_and_mul(x), SiluAndMul()(plain(x)))  # same sums, same roundings


def test_no_fused_silu_for_widths_off_the_group_grid(kernels) -> None:
    group = kernels.gemm_layout(torch.bfloat16).silu_group
    features = group + group // 2
    layer = MergedColumnParallelLinear(64, [features, features], dtype=torch.bfloat16)
    layer.pack_for_silu_and_mul()
    assert layer.silu_packed is None and layer.weight.shape == (2 * features, 64)  # left to the plain packing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_weight_packed_a_slice_at_a_time_is_the_weight_packed_whole(kernels, dtype: torch.dtype,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused SiLU's reordered packing gathers and packs whole blocks of rows at a time (no reordered copy of
    the whole weight while loading): the bytes of the reordered weight packed at once, a part block at the end."""
    from pagedllm.layers import prepack

    layout = kernels.gemm_layout(dtype)
    rows = 5 * layout.block + 2 * layout.lanes  # the last block part-filled
    weight = torch.randn(rows, 96, generator=torch.Generator().manual_seed(0)).to(dtype)
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(prepack, "_PACK_SLICE_BYTES", 1)  # a block a slice
    assert torch.equal(prepack._pack_in_order(kernels, weight, order), kernels.gemm_pack(weight[order]))
