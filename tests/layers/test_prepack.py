"""Packed weights at every level: our GEMM where the kernels run (float32, bf16, f16), oneDNN's
packing for bf16 at the portable level; the same products as F.linear, the plain copy dropped,
the LM head's kept (it is the embedding table when tied)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from pagedllm.layers.prepack import _onednn_available, can_prepack, matmul_for, prepack

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _packs_here(level: str, dtype: torch.dtype) -> bool:
    return level != "portable" or (dtype == torch.bfloat16 and _onednn_available())


@pytest.mark.parametrize("layer_cls", [ColumnParallelLinear, RowParallelLinear])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_packed_linear_matches_f_linear(level: str, layer_cls: type, dtype: torch.dtype, bias: bool,
                                        rows: int) -> None:
    if not _packs_here(level, dtype):
        pytest.skip("nothing packs this dtype at this level")
    g = torch.Generator().manual_seed(rows)
    layer = layer_cls(96, 160, bias=bias, dtype=dtype)
    weight = torch.randn(160, 96, generator=g).to(dtype)
    layer.weight.data.copy_(weight)
    if bias:
        layer.bias.data.copy_(torch.randn(160, generator=g).to(dtype))
    x = torch.randn(rows, 96, generator=g).to(dtype)

    def reference(inp: torch.Tensor) -> torch.Tensor:
        ref = F.linear(inp.float(), weight.float())
        b = layer.bias.float() if bias else 0
        if layer_cls is RowParallelLinear:  # the row-parallel layer adds its bias after the all-reduce
            return (ref.to(dtype).float() + b).to(dtype)
        return (ref + b).to(dtype)

    layer.process_weights_after_loading()
    assert layer.packed_weight is not None and layer.weight.numel() == 0  # the plain copy is dropped
    torch.testing.assert_close(layer(x), reference(x), atol=TOL[dtype] * 10, rtol=TOL[dtype])
    strided = torch.randn(rows, 2, 96, generator=g).to(dtype)[:, 1]  # non-contiguous: the reshape path
    torch.testing.assert_close(layer(strided), reference(strided), atol=TOL[dtype] * 10, rtol=TOL[dtype])


def test_shapes_no_packer_takes_stay_plain(level: str) -> None:
    odd = ColumnParallelLinear(8, 12, dtype=torch.float32)  # 12 outputs: not a whole vector at any level
    odd.process_weights_after_loading()
    assert odd.packed_weight is None and odd.weight.shape == (12, 8) and not can_prepack(odd.weight)
    merged = MergedColumnParallelLinear(32, [16, 16], dtype=torch.bfloat16)
    merged.weight.data.copy_(torch.randn(32, 32).to(torch.bfloat16))
    x = torch.randn(5, 32).to(torch.bfloat16)
    expected = F.linear(x, merged.weight)
    merged.process_weights_after_loading()
    torch.testing.assert_close(merged(x), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("tied", [True, False])
def test_lm_head_keeps_its_plain_weight_only_when_tied(level: str, tied: bool) -> None:
    """A tied head's weight is the embedding table (kept beside the packed copy); an untied one's plain weight is
    dropped once packed (the packed copy replaces it: Llama-3-8B's is 1 GiB in bf16)."""
    if not _packs_here(level, torch.bfloat16):
        pytest.skip("nothing packs bf16 at this level")
    head = ParallelLMHead(512, 64, torch.bfloat16)
    if tied:
        table = VocabParallelEmbedding(512, 64, torch.bfloat16)
        head.tie(table)
    head.weight.data.copy_(torch.randn(512, 64).to(torch.bfloat16))
    h = torch.randn(3, 64).to(torch.bfloat16)
    expected = F.linear(h, head.weight).float()
    head.process_weights_after_loading()
    assert head.packed_weight is not None
    assert head.weight.shape == ((512, 64) if tied else (0,))
    if tied:
        assert head.weight is table.weight  # the embedding still looks its rows up
    torch.testing.assert_close(head.compute_logits(h), expected, atol=1e-2, rtol=1e-2)


def test_onednn_row_counts_are_bounded_and_rows_unchanged() -> None:
    """oneDNN gets few distinct row counts (rounded up, zero rows added) and each row's product is its own."""
    from pagedllm.layers.prepack import onednn_rows

    counts = {onednn_rows(r) for r in range(1, 8193)}
    assert len(counts) <= 32 + 15 + 56 + 16 and all(onednn_rows(r) >= r for r in range(1, 8193))
    assert onednn_rows(32) == 32 and onednn_rows(33) == 64 and onednn_rows(2040) == 2048
    if not can_prepack(torch.empty(8, 8, dtype=torch.bfloat16)) or prepack(
            torch.empty(8, 8, dtype=torch.bfloat16)).kernels is not None:
        pytest.skip("oneDNN does not pack bf16 here")
    torch.manual_seed(0)
    weight = torch.randn(96, 64, dtype=torch.bfloat16)
    matmul = matmul_for(prepack(weight), None)
    x = torch.randn(70, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(matmul(x), matmul(torch.cat([x, x[:58]]))[:70], rtol=0, atol=0)
    assert matmul(x).shape == (70, 96)


@pytest.fixture
def amx_level():  # noqa: ANN201 - the "amx" level made the active one, or a skip where the CPU has none
    from pagedllm import platform
    from tests.utils import amx_kernels

    kernels = amx_kernels()
    with platform.use_level("amx"):
        yield kernels


@pytest.mark.parametrize("out_features, in_features", [(960, 576), (48, 64), (16, 32), (2048, 8192)])
def test_amx_gemm_matches_the_float_product(amx_level, out_features: int, in_features: int) -> None:
    """The AMX GEMM (csrc/gemm_amx.cpp) over the plain weight: 1 to 32 rows (one or two tiles of 16, a last unit
    of 16 weight rows), x a column slice (row stride > K) and out a column slice; within bf16 output rounding."""
    from pagedllm.layers.cpu_ops import AMX_GEMM_ROWS

    g = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    wide = torch.randn(AMX_GEMM_ROWS, in_features + 32, generator=g).bfloat16()
    for rows in (1, 5, 16, 17, 32):
        x = wide[:rows, 16:16 + in_features]  # (rows, in), row stride in + 32
        out = torch.full((rows, out_features + 16), float("nan"), dtype=torch.bfloat16)[:, 8:8 + out_features]
        amx_level.amx_gemm(x, w, out)
        ref = x.float() @ w.float().t()
        torch.testing.assert_close(out.float(), ref, rtol=2 ** -7, atol=2 ** -7 * ref.abs().max().item())
    with pytest.raises(RuntimeError, match="amx_gemm takes"):  # more rows than two tiles: the caller's error
        amx_level.amx_gemm(torch.randn(AMX_GEMM_ROWS + 1, in_features).bfloat16(), w,
                           torch.empty(AMX_GEMM_ROWS + 1, out_features, dtype=torch.bfloat16))


@pytest.mark.parametrize("bias", [False, True])
def test_amx_level_keeps_bf16_weights_plain(amx_level, bias: bool) -> None:
    """At the amx level a bf16 weight is not copied (AMX tiles read it plain): up to 32 rows run the AMX GEMM, more
    go to F.linear over the same weight; both agree with F.linear, bias included. Shapes the tiles do not take
    (K not a multiple of 32) go to oneDNN's packed copy."""
    for layer_cls in (ColumnParallelLinear, RowParallelLinear):
        layer = layer_cls(96, 160, bias=bias, dtype=torch.bfloat16)
        g = torch.Generator().manual_seed(3)
        weight = torch.randn(160, 96, generator=g).bfloat16()
        layer.weight.data.copy_(weight)
        if bias:
            layer.bias.data.copy_(torch.randn(160, generator=g).bfloat16())
        layer.process_weights_after_loading()
        assert layer.packed_weight is not None and layer.packed_weight.amx
        assert torch.equal(layer.packed_weight.data, weight)  # the weight itself, no packed copy
        for rows in (1, 32, 33, 300):
            x = torch.randn(rows, 96, generator=g).bfloat16()
            ref = F.linear(x.float(), weight.float(), None if not bias else layer.bias.float())
            torch.testing.assert_close(layer(x).float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    odd = prepack(torch.randn(160, 40).bfloat16())
    assert not odd.amx and odd.kernels is None  # oneDNN's packed copy
