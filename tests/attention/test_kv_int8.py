"""The int8 KV cache (kv_cache_dtype="int8"): its torch reference (attention/kv_quant.py) against plain
arithmetic, and the compiled kernels (csrc/kv_int8.cpp: slot write and paged attention) against that
reference at every kernel level this CPU runs (the `kernels` fixture forces each), on the vector and
the scalar paths, with sliding windows and soft caps."""
from __future__ import annotations

import pytest
import torch

from pagedllm.attention import kv_quant
from pagedllm.attention.cpu_backend import CpuAttentionBackend
from pagedllm.attention.torch_backend import TorchAttentionBackend
from tests.attention.batches import make_step

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def int8_cache(cache: torch.Tensor) -> torch.Tensor:
    """A float cache (2, blocks, kv_heads, bs, head_dim) quantized slot by slot into the int8 layout."""
    _, blocks, heads, bs, d = cache.shape
    out = torch.zeros(TorchAttentionBackend.kv_cache_shape(blocks, bs, heads, d, torch.int8), dtype=torch.int8)
    slots = torch.arange(blocks * bs)

    def rows(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).reshape(blocks * bs, heads, d)  # (blocks * bs, heads, d): slot by slot

    kv_quant.write(out, rows(cache[0]), rows(cache[1]), slots // bs, slots % bs)
    return out


def test_quantize_and_layout() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-3, 2, 50)[:, None, None]
    x[7, 1] = 0.0  # a zero slot: scale 0, values 0
    q, scale = kv_quant.quantize(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == (50, 3)
    assert int(q.abs().max()) <= 127 and bool((q[7, 1] == 0).all()) and float(scale[7, 1]) == 0.0
    err = (kv_quant.round_trip(x) - x).abs()
    assert bool((err <= scale.float().unsqueeze(-1) * 0.5 * 1.01 + 1e-12).all())  # within half a step
    assert float((err / x.abs().amax(-1, keepdim=True).clamp(min=1e-9)).max()) < 1 / 250
    # the layout: K dim-major then scales, V token rows then scales, one run of bytes per (block, head)
    cache = torch.zeros(TorchAttentionBackend.kv_cache_shape(4, 16, 3, 64, torch.int8), dtype=torch.int8)
    assert cache.shape == (2, 4, 3, 16 * 66)
    kv_quant.write(cache, x[:1], -x[:1], torch.tensor([2]), torch.tensor([5]))
    kq, ks = kv_quant.quantize(x[0])
    assert torch.equal(cache[0, 2, 1, : 64 * 16].view(64, 16)[:, 5], kq[1])
    assert torch.equal(cache[1, 2, 1, : 16 * 64].view(16, 64)[5], -kq[1])
    assert torch.equal(cache[0, 2, 1, 64 * 16:].view(torch.float16)[5], ks[1])
    assert int(cache[:, [0, 1, 3]].abs().sum()) == 0  # nothing else written


SHAPES = [(9, 3, 64, 16), (4, 4, 32, 4), (8, 1, 128, 8), (6, 2, 48, 16), (10, 2, 128, 32), (5, 5, 40, 16)]
"""(heads, kv_heads, head_dim, block_size): vector and scalar paths at 8 and 16 lanes, GQA groups 1-5."""


@pytest.mark.parametrize("dtype, heads, kv_heads, head_dim, block_size",
                         [(dt, *shape) for dt in (torch.float32, torch.bfloat16) for shape in SHAPES]
                         + [(torch.float16, *shape) for shape in SHAPES[:2]])  # f16 only converts q and out
def test_kernel_matches_torch_reference(kernels, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                                        block_size: int) -> None:
    """Decodes and a prompt chunk after a cached prefix: the same bytes written, the same outputs (both read
    the quantized context), and close to attention over the float context (the quantization error only)."""
    step = make_step([1, 5, block_size, block_size + 1, 37, 200], prefill=9, block_size=block_size, num_blocks=90,
                     seed=heads)
    g = torch.Generator().manual_seed(7)
    floats = torch.randn(TorchAttentionBackend.kv_cache_shape(90, block_size, kv_heads, head_dim), generator=g)
    n = step.slot_mapping.shape[0]
    q = torch.randn(n, heads, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(n, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    outs, caches = [], []
    for backend in (TorchAttentionBackend(), CpuAttentionBackend()):
        cache = int8_cache(floats)
        outs.append(backend.forward(q, k, v, cache, backend.make_builder().build(step), head_dim ** -0.5).float())
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])
    torch.testing.assert_close(outs[1], outs[0], atol=TOL[dtype], rtol=TOL[dtype])
    exact = TorchAttentionBackend().forward(q, k, v, floats.to(dtype),
                                            TorchAttentionBackend().make_builder().build(step),
                                            head_dim ** -0.5).float()
    torch.testing.assert_close(outs[1], exact, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("window, softcap", [(5, None), (37, None), (None, 2.0), (16, 2.0)])
@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (48, 8)])
def test_sliding_window_and_soft_cap(kernels, window: int | None, softcap: float | None, head_dim: int,
                                     block_size: int) -> None:
    step = make_step([1, 5, 17, 37, 200], 0, block_size=block_size, num_blocks=120, seed=5,
                     chunks=[(9, 9), (12, 60), (40, 40)])
    g = torch.Generator().manual_seed(11)
    floats = torch.randn(TorchAttentionBackend.kv_cache_shape(120, block_size, 2, head_dim), generator=g)
    n = step.slot_mapping.shape[0]
    q, k, v = (torch.randn(n, h, head_dim, generator=g).to(torch.bfloat16) for h in (6, 2, 2))
    outs = [backend.forward(q, k, v, int8_cache(floats), backend.make_builder().build(step), head_dim ** -0.5, window,
                            softcap).float() for backend in (TorchAttentionBackend(), CpuAttentionBackend())]
    torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=2e-2)
    full = TorchAttentionBackend().forward(q, k, v, int8_cache(floats), TorchAttentionBackend().make_builder().build(
        step), head_dim ** -0.5).float()
    assert not torch.allclose(outs[0], full, atol=1e-2)  # the window / cap changed the result: the test bites


TILE_STEP = [(1, 37), (70, 70), (1, 300), (60, 161), (3, 20), (300, 300)]
"""Decodes, fresh prompts of 70 and 300 rows, a chunk after 101 cached positions, a 3-row verify-like run."""


def _int8_tiles_and_rows(kernels, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                         window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 kernel's output for TILE_STEP with prompt tiles (the window dequantized, attention.cpp's tile paths)
    and row by row (the int8 values read in place)."""
    from tests.attention.test_prompt_tiles import _both, _step

    q, kc, vc, tables, lens = _step(TILE_STEP, heads, kv_heads, head_dim, 16, torch.float32, seed=heads + head_dim)
    cache = int8_cache(torch.stack([kc, vc]))
    assert kernels.attention_prompt_tiles(tables, lens, heads, kv_heads, 16) > 0  # tiles form
    starts = None if window is None else (lens - window).clamp(min=0).to(torch.int32)
    return _both(kernels, q.to(dtype), cache[0], cache[1], tables, lens, starts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 8, 64), (8, 2, 128), (12, 4, 64)])
def test_prompt_tiles_match_rows(kernels, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    """Prompt rows of an int8 cache attend in tiles: float32 within rounding of the rows' numbers (the scale
    multiplies K before the dot product, not after); bf16 within the roundings of the dequantized K/V and of the
    bf16 weights the fused tile multiplies into V."""
    tiled, rows = _int8_tiles_and_rows(kernels, dtype, heads, kv_heads, head_dim)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6
    torch.testing.assert_close(tiled.float(), rows.float(), rtol=tol, atol=tol)
    assert not torch.equal(tiled, rows)  # the tiles ran (their rounding differs from the rows')
    assert not torch.allclose(tiled[70:72].float(), tiled[71:73].float(), atol=2 ** -4)  # each row its own length


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prompt_tiles_under_windows(kernels, amx: bool, head_dim: int) -> None:
    """Sliding windows (a window's first block dequantized first, mid-block starts masked), bf16, on vdpbf16ps or
    AMX tiles (the "amx" level)."""
    if amx:
        from tests.utils import amx_kernels

        if kernels.level != "avx512_bf16":
            pytest.skip("AMX tiles run in the avx512_bf16 library")
        kernels = amx_kernels()
    tiled, rows = _int8_tiles_and_rows(kernels, torch.bfloat16, 8, 2, head_dim, window=45)
    torch.testing.assert_close(tiled.float(), rows.float(), rtol=2 ** -6, atol=2 ** -6)
    full, _ = _int8_tiles_and_rows(kernels, torch.bfloat16, 8, 2, head_dim)
    assert not torch.allclose(tiled.float(), full.float(), atol=2 ** -4)  # the window took effect


def test_amx_prompt_tiles_match_rows() -> None:
    """The int8 cache's bf16 prompt tiles on AMX tiles, against its own row path."""
    from tests.utils import amx_kernels

    kernels = amx_kernels()
    for heads, kv_heads, head_dim in [(8, 8, 64), (8, 2, 128), (9, 3, 64)]:
        tiled, rows = _int8_tiles_and_rows(kernels, torch.bfloat16, heads, kv_heads, head_dim)
        torch.testing.assert_close(tiled.float(), rows.float(), rtol=2 ** -6, atol=2 ** -6)
