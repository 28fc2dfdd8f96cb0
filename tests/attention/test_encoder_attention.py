"""The compiled bidirectional attention of encoder-only models (csrc/encoder.cpp) at every kernel level this CPU
runs, against float64 attention per sequence: whole sequences of mixed lengths (1 token, lengths off the vector
width, longer than a work item's block of rows), q / k / v read in place from a packed projection, windowed bands
(ModernBERT's local layers), head_dim 32 to 128, float32 / bfloat16 / float16; and the ``EncoderAttention`` op,
which sends long sequences to SDPA."""
from __future__ import annotations

import pytest
import torch

from pagedllm.attention.encoder import KERNEL_UP_TO, EncoderAttention, bidirectional_attention
from tests.utils import amx_kernels

MIXED = [5, 1, 37, 16, 64, 65, 17, 9, 130, 2, 33]
"""Lengths around the tiles: 16-key vectors, 32-key steps, 64-row work items."""
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float,
              window: int | None = None) -> torch.Tensor:
    """float64 softmax(q k^T * scale) v per sequence (keys at most ``window`` positions away) -> (tokens, heads, d)."""
    out, start = [], 0
    for n in lens:
        qs, ks, vs = (x[start:start + n].double().transpose(0, 1) for x in (q, k, v))  # (heads, n, d)
        scores = qs @ ks.transpose(1, 2) * scale
        if window is not None:
            i = torch.arange(n)
            scores = scores.masked_fill((i.unsqueeze(1) - i).abs() > window, float("-inf"))
        out.append((torch.softmax(scores, -1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(out)


def packed_qkv(lens: list[int], heads: int, d: int, dtype: torch.dtype, seed: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (tokens, heads, d) as views of one (tokens, 3 * heads * d) projection output (token stride 3x)."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(sum(lens), 3 * heads * d, generator=g) * 1.5).to(dtype)
    return tuple(x.view(-1, heads, d) for x in qkv.chunk(3, dim=-1))  # type: ignore[return-value]


def starts_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lens", [MIXED, [1], [200], [16] * 40])
def test_matches_float64_attention(kernels, dtype: torch.dtype, lens: list[int]) -> None:
    q, k, v = packed_qkv(lens, 3, 32, dtype)
    assert q.shape[0] == 1 or q.stride(0) == 3 * 3 * 32  # read in place: no contiguous copy
    out = kernels.encoder_attention(q, k, v, starts_of(lens), 32 ** -0.5)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out.double(), reference(q, k, v, lens, 32 ** -0.5), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wider_heads(kernels, d: int, dtype: torch.dtype) -> None:
    q, k, v = packed_qkv(MIXED, 2, d, dtype, seed=1)
    out = kernels.encoder_attention(q, k, v, starts_of(MIXED), d ** -0.5)
    torch.testing.assert_close(out.double(), reference(q, k, v, MIXED, d ** -0.5), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("window", [0, 3, 20, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windowed_band(kernels, window: int, dtype: torch.dtype) -> None:
    lens = [300, *MIXED]  # 300: work items whose keys start past the sequence's first
    q, k, v = packed_qkv(lens, 2, 32, dtype, seed=2)
    out = kernels.encoder_attention(q, k, v, starts_of(lens), 0.2, window)
    torch.testing.assert_close(out.double(), reference(q, k, v, lens, 0.2, window), atol=TOL[dtype], rtol=TOL[dtype])


def test_longer_sequences_are_left_to_the_caller(kernels) -> None:
    lens = [10, 120, 7]
    q, k, v = packed_qkv(lens, 2, 32, torch.float32)
    out = kernels.encoder_attention(q, k, v, starts_of(lens), 0.2, None, 100)
    ref = reference(q, k, v, lens, 0.2)
    torch.testing.assert_close(out[:10].double(), ref[:10], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[130:].double(), ref[130:], atol=1e-5, rtol=1e-5)


def test_refuses_what_it_cannot_take(kernels) -> None:
    q, k, v = packed_qkv([4, 4], 2, 48, torch.float32)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.encoder_attention(q, k, v, starts_of([4, 4]), 0.2)
    q, k, v = packed_qkv([4, 4], 2, 32, torch.float32)
    with pytest.raises(RuntimeError, match="sequence 1 has 0 tokens"):
        kernels.encoder_attention(q, k, v, torch.tensor([0, 8, 8], dtype=torch.int32), 0.2)


@pytest.mark.parametrize("window", [None, 16])
def test_op_matches_the_native_path_at_every_level(level: str, window: int | None) -> None:
    """The op bound at each level (the portable one: torch's SDPA buckets) gives the same attention; sequences
    past KERNEL_UP_TO go to SDPA one by one when there is no window."""
    lens = [KERNEL_UP_TO + 40, *MIXED, KERNEL_UP_TO]
    op = EncoderAttention(4, 32, 32 ** -0.5, window, torch.float32)
    assert op.implementation == ("forward_native" if level == "portable" else "forward_cpu")
    q, k, v = packed_qkv(lens, 4, 32, torch.float32, seed=3)
    out = op(q, k, v, lens)
    torch.testing.assert_close(out.double(), reference(q, k, v, lens, 32 ** -0.5, window), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, bidirectional_attention(q, k, v, lens, 32 ** -0.5, window), atol=1e-5, rtol=1e-5)


def test_op_keeps_odd_head_dims_on_the_native_path(kernels) -> None:
    assert EncoderAttention(2, 48, 0.1, dtype=torch.float32).implementation == "forward_native"


@pytest.mark.parametrize(("lens", "d", "window"), [(MIXED, 32, None), ([1], 32, None), ([300], 32, None),
                                                   ([16] * 40, 32, None), (MIXED, 64, None), (MIXED, 96, None),
                                                   (MIXED, 128, None), ([300, *MIXED], 32, 20),
                                                   ([300, *MIXED], 64, 0), ([300, *MIXED], 64, 64)])
def test_amx_tiles_match_float64_attention(lens: list[int], d: int, window: int | None) -> None:
    """bfloat16 on AMX tiles (blocks of 16 rows: partial blocks, 1 to 4 chunks of 32 dims, outputs in 64-dim
    groups) against float64, and against the vdpbf16ps path of the same library."""
    kernels = amx_kernels()
    from pagedllm.layers import cpu_ops

    q, k, v = packed_qkv(lens, 3, d, torch.bfloat16, seed=4)
    out = kernels.encoder_attention(q, k, v, starts_of(lens), d ** -0.5, window)
    ref = reference(q, k, v, lens, d ** -0.5, window)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    vector = cpu_ops.kernels("avx512_bf16").encoder_attention(q, k, v, starts_of(lens), d ** -0.5, window)
    assert not vector.equal(out) or lens == [1] or window == 0  # a different path: the sums' order differs
    torch.testing.assert_close(out.float(), vector.float(), atol=1.6e-2, rtol=1.6e-2)
