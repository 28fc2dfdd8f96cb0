"""The AVX512-BF16 GEMM (layers/csrc/gemm_bf16.cpp) against a float32 product rounded to bf16.

Sums are float32 in both; only their order differs, so each output may be one bf16 rounding
step away from the reference, never more. Shapes cover every register-tile remainder (rows mod
6), every packed block width (16, 32, 48, 64 outputs) and strided input rows.
"""
from __future__ import annotations

import pytest
import torch

from pagedllm.layers.cpu_ops import fused_ops

OPS = fused_ops(torch.empty(0, dtype=torch.bfloat16))
pytestmark = pytest.mark.skipif(OPS is None, reason="the C++ ops do not build here (no compiler or no AVX512-BF16)")


def _check(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    out = OPS.gemm_bf16(x, OPS.gemm_pack(w), w.shape[0], bias, False)
    ref = x.float() @ w.float().t() + (bias.float() if bias is not None else 0)
    expected = ref.bfloat16().float()
    ulp = expected.abs().clamp_min(1e-30) * 2 ** -7  # one bf16 step (8 significant bits)
    assert out.shape == (x.shape[0], w.shape[0]) and out.dtype == torch.bfloat16
    assert ((out.float() - expected).abs() <= ulp + 1e-6).all()
    assert (out.float() == expected).float().mean() > 0.9


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 300])
@pytest.mark.parametrize("out_features,in_features", [(64, 576), (80, 98), (112, 2), (48, 1536), (16, 64)])
def test_gemm_matches_float32_reference(rows: int, out_features: int, in_features: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    w = (torch.randn(out_features, in_features, generator=g) * 0.1).bfloat16()
    _check(x, w, None)
    _check(x, w, torch.randn(out_features, generator=g).bfloat16())


def test_gemm_reads_strided_rows_and_many_chunks() -> None:
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(700, 3, 96, generator=g).bfloat16()
    _check(wide[:, 1], (torch.randn(960, 96, generator=g) * 0.1).bfloat16(), None)  # row stride 288, 700 rows


def test_gemm_rejects_shapes_it_cannot_pack() -> None:
    with pytest.raises(RuntimeError, match="out_features % 16"):
        OPS.gemm_pack(torch.zeros(20, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="even in_features"):
        OPS.gemm_pack(torch.zeros(32, 63, dtype=torch.bfloat16))


@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_with_fused_silu_equals_gemm_then_silu(bias: bool) -> None:
    from pagedllm.layers.activation import SiluAndMul
    from pagedllm.layers.linear import MergedColumnParallelLinear

    g = torch.Generator().manual_seed(11)
    fused, plain = (MergedColumnParallelLinear(96, [160, 160], bias=bias, dtype=torch.bfloat16) for _ in range(2))
    weight = (torch.randn(320, 96, generator=g) * 0.2).bfloat16()
    bias_values = torch.randn(320, generator=g).bfloat16()
    for layer in (fused, plain):
        layer.weight.data.copy_(weight)
        if bias:
            layer.bias.data.copy_(bias_values)
    fused.pack_for_silu_and_mul()
    plain.process_weights_after_loading()
    assert fused.silu_packed is not None and plain.silu_and_mul(torch.zeros(1, 96, dtype=torch.bfloat16)) is None
    for rows in (1, 7, 300):
        x = torch.randn(rows, 96, generator=g).bfloat16()
        assert torch.equal(fused.silu_and_mul(x), SiluAndMul()(plain(x)))  # same sums, same roundings


def test_no_fused_silu_for_widths_off_the_block_grid() -> None:
    from pagedllm.layers.linear import MergedColumnParallelLinear

    layer = MergedColumnParallelLinear(64, [48, 48], dtype=torch.bfloat16)
    layer.pack_for_silu_and_mul()
    assert layer.silu_packed is None and layer.weight.shape == (96, 64)  # left to the plain packing
