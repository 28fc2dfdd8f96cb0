"""oneDNN-prepacked bf16 weights: same products as F.linear, plain copy dropped, LM head kept."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.embedding import ParallelLMHead
from pagedllm.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from pagedllm.layers.prepack import can_prepack

pytestmark = pytest.mark.skipif(not can_prepack(torch.empty(1, 1, dtype=torch.bfloat16)),
                                reason="this torch/oneDNN build has no bf16 prepacking here")


@pytest.mark.parametrize("layer_cls", [ColumnParallelLinear, RowParallelLinear])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_packed_linear_matches_f_linear(layer_cls: type, bias: bool, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    layer = layer_cls(96, 160, bias=bias, dtype=torch.bfloat16)
    weight = torch.randn(160, 96, generator=g).to(torch.bfloat16)
    layer.weight.data.copy_(weight)
    if bias:
        layer.bias.data.copy_(torch.randn(160, generator=g).to(torch.bfloat16))
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)

    def reference(inp: torch.Tensor) -> torch.Tensor:
        if layer_cls is RowParallelLinear and bias:  # the row-parallel layer adds its bias after the all-reduce
            return F.linear(inp, weight) + layer.bias
        return F.linear(inp, weight, layer.bias)

    expected = reference(x)
    layer.process_weights_after_loading()
    assert layer.packed_weight is not None and layer.weight.numel() == 0  # the plain copy is dropped
    torch.testing.assert_close(layer(x), expected, atol=1e-2, rtol=1e-2)
    strided = torch.randn(rows, 2, 96, generator=g).to(torch.bfloat16)[:, 1]  # non-contiguous: the reshape path
    torch.testing.assert_close(layer(strided), reference(strided), atol=1e-2, rtol=1e-2)


def test_float32_and_merged_layers() -> None:
    fp32 = ColumnParallelLinear(8, 8, dtype=torch.float32)
    fp32.process_weights_after_loading()
    assert fp32.packed_weight is None and fp32.weight.shape == (8, 8)  # only bf16 is packed
    merged = MergedColumnParallelLinear(32, [16, 16], dtype=torch.bfloat16)
    merged.weight.data.copy_(torch.randn(32, 32).to(torch.bfloat16))
    x = torch.randn(5, 32).to(torch.bfloat16)
    expected = F.linear(x, merged.weight)
    merged.process_weights_after_loading()
    torch.testing.assert_close(merged(x), expected, atol=1e-2, rtol=1e-2)


def test_lm_head_keeps_its_plain_weight() -> None:
    head = ParallelLMHead(500, 64, torch.bfloat16)
    head.weight.data.copy_(torch.randn(500, 64).to(torch.bfloat16))
    h = torch.randn(3, 64).to(torch.bfloat16)
    expected = F.linear(h, head.weight).float()
    head.process_weights_after_loading()
    assert head.packed_weight is not None and head.weight.shape == (500, 64)  # tied: it is the embedding too
    torch.testing.assert_close(head.compute_logits(h), expected, atol=1e-2, rtol=1e-2)
