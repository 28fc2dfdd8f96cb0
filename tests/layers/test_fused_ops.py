"""The fused ops (pagedllm/csrc/fused.cpp) at every kernel level this CPU runs, against the torch
expressions they replace, for float32, bfloat16 and float16 storage.

They reproduce torch's rounding op by op (and torch's float32 summation order in RMSNorm), so
norm and rotary are compared bit for bit, including widths that leave a partial vector.
"""
from __future__ import annotations

import pytest
import torch

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.layers.sampler import inverse_cdf_sample

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _activations(rows: int, cols: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # heavy-tailed like real hidden states (a few huge channels), so the float32 sums carry rounding
    scale = 2 if dtype != torch.float16 else 1  # float16 overflows past 65504
    return (torch.randn(rows, cols, generator=g) * torch.exp(scale * torch.randn(rows, cols, generator=g))).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 576), (300, 576), (1100, 576), (5, 100), (33, 4104)])
def test_rms_norm_matches_torch_bitwise(kernels, dtype: torch.dtype, rows: int, hidden: int) -> None:
    norm = RMSNorm(hidden, 1e-5, dtype)
    norm.weight.data = _activations(1, hidden, 1, dtype)[0]
    x, res = _activations(rows, hidden, 2, dtype), _activations(rows, hidden, 3, dtype)
    assert norm.implementation == "forward_cpu"  # bound at construction, inside the level's fixture
    expect = norm.forward_native(x)
    expect_out, expect_sum = norm.forward_native(x, res.clone())
    assert torch.equal(norm(x), expect)
    res_in = res.clone()
    out, new_res = norm(x, res_in)
    assert torch.equal(out, expect_out) and torch.equal(new_res, expect_sum)
    assert new_res.data_ptr() == res_in.data_ptr()  # the sum is written into the residual buffer


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 4, 2), (96, 3, 1), (20, 2, 2)])
def test_rotary_in_place_matches_torch_bitwise(kernels, dtype: torch.dtype, head_dim: int, heads: int,
                                               kv_heads: int) -> None:
    rot = RotaryEmbedding(head_dim, 4096, 10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 1024}, dtype)
    rows = 40
    qkv = _activations(rows, (heads + 2 * kv_heads) * head_dim, 4, dtype)
    positions = torch.randint(0, 4096, (rows,), generator=torch.Generator().manual_seed(5))
    expect = rot.forward_native(positions, qkv.clone(), heads, kv_heads)
    got = rot(positions, qkv.clone(), heads, kv_heads)
    for e, g in zip(expect, got):
        assert torch.equal(e, g)
    assert got[0].shape == (rows, heads, head_dim) and got[2].shape == (rows, kv_heads, head_dim)


def test_rotary_rejects_positions_outside_the_table(kernels) -> None:
    rot = RotaryEmbedding(64, 128, 10000.0, None, torch.bfloat16)
    qkv = torch.zeros(2, 5 * 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        rot(torch.tensor([3, 128]), qkv, 3, 1)
    assert not qkv.any()  # checked before anything is written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 1536), (64, 1536), (600, 1536), (9, 100)])
def test_silu_and_mul_matches_torch(kernels, dtype: torch.dtype, rows: int, d: int) -> None:
    act = SiluAndMul()
    x = _activations(rows, 2 * d, 6, dtype)
    x[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # exp overflow and underflow, signed zero
    expect = act.forward_native(x)
    got = act(x)
    # torch's exp and this one may differ in the last float32 bits, which moves a rounding of T rarely
    diff = (got.float() - expect.float()).abs() / expect.float().abs().clamp_min(1e-30)
    if dtype == torch.float32:
        assert diff.max() <= 1e-6
    else:
        assert (got != expect).float().mean() < 1e-3 and diff.max() <= 2 ** -7


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_draw_matches_the_torch_inverse_cdf(kernels, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    rows = 64
    logits = (torch.randn(rows, 49_155, generator=g) * 4).to(dtype)  # a partial last chunk of the 256-token chunks
    logits[:, 100:200] = float("-inf")  # blocked tokens
    temperature = torch.rand(rows, generator=g) + 0.3
    u = 1.0 - torch.rand(rows, generator=g)
    scaled = logits.float() / temperature.unsqueeze(1)
    expect = inverse_cdf_sample(scaled.sub(scaled.max(-1, keepdim=True).values).exp(), u)
    got = kernels.sample(logits, temperature, u)
    # the same draw up to float32 summation order: a u within an ulp of a token boundary could differ
    assert (got == expect).float().mean() >= 0.95
    assert not ((got >= 100) & (got < 200)).any()


def test_fused_draw_follows_the_softmax_distribution(kernels) -> None:
    vocab, rows = 300, 40_000
    g = torch.Generator().manual_seed(8)
    row = torch.randn(vocab, generator=g) * 2
    row[7] = float("-inf")
    draws = kernels.sample(row.expand(rows, vocab).contiguous(), torch.full((rows,), 0.8),
                           1.0 - torch.rand(rows, generator=g))
    freq = torch.bincount(draws, minlength=vocab).float() / rows
    probs = torch.softmax(row / 0.8, -1)
    assert freq[7] == 0 and (freq - probs).abs().max() < 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_draw_reads_half_logits_as_their_float32_copy(kernels, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(9)
    logits = (torch.randn(32, 1000, generator=g) * 3).to(dtype)
    logits[:, :10] = float("-inf")
    u, temperature = 1.0 - torch.rand(32, generator=g), torch.full((32,), 0.9)
    assert torch.equal(kernels.sample(logits, temperature, u), kernels.sample(logits.float(), temperature, u))


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_matches_torch_first_of_ties(kernels, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(10)
    logits = (torch.randn(9, 49_157, generator=g) * 3).to(dtype)
    logits[1, 7] = logits[1, 40_000] = 100  # a tie: the first index wins
    logits[2, -1] = 100  # in the last, partial vector
    logits[3, :] = float("-inf")
    assert torch.equal(kernels.argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(kernels.argmax(logits[:, :1000]), logits[:, :1000].argmax(dim=-1))  # strided rows
