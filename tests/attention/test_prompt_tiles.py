"""Prompt tiles (csrc/attention.cpp): consecutive rows of one prompt chunk attend as one task per KV head that reads
each K/V block once for all of them. A row's numbers are the ones it gets alone, bit for bit, at every kernel level
(the `kernels` fixture forces each), for float32, bf16 and float16 caches, MHA and GQA, head_dim 64 and 128 (the FMA
path) and the shapes that keep the row path (head_dim 48, blocks of 8), beside decode rows, after a cached prefix,
under sliding windows and soft caps; rows of different requests never share a tile. On the vdpbf16ps path (bf16 at
AVX512-BF16) a tile's P.V runs on bf16 weights, as torch's flash attention does: within a bf16 rounding or two."""
from __future__ import annotations

import pytest
import torch

from pagedllm.attention.torch_backend import TorchAttentionBackend
from tests.utils import amx_kernels


def _step(requests: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, block_size: int,
          dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q (rows, heads, head_dim), key and value caches (blocks in random order), each row's block table (its
    request's) and length, for requests of (query rows, context length): a decode is (1, n), a fresh prompt chunk
    (n, n), a chunk after a cached prefix (q, n) with q < n."""
    g = torch.Generator().manual_seed(seed)
    per_req = [-(-n // block_size) for _, n in requests]
    blocks = sum(per_req) + 1
    cache = torch.randn(TorchAttentionBackend.kv_cache_shape(blocks, block_size, kv_heads, head_dim), generator=g)
    cache = cache.to(dtype)
    perm = (torch.randperm(blocks - 1, generator=g) + 1).to(torch.int32)
    tables, lens, used = [], [], 0
    for (query, n), count in zip(requests, per_req):
        table = torch.zeros(max(per_req), dtype=torch.int32)
        table[:count] = perm[used:used + count]
        used += count
        tables += [table] * query
        lens += range(n - query + 1, n + 1)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    return q, cache[0], cache[1], torch.stack(tables), torch.tensor(lens, dtype=torch.int32)


def _assert_tiles_match_rows(kernels, tiled: torch.Tensor, rows: torch.Tensor, head_dim: int, block_size: int) -> None:
    """Bit for bit, or within two bf16 roundings where the tile's P.V runs on bf16 weights (vdpbf16ps)."""
    if tiled.dtype == torch.bfloat16 and kernels.level == "avx512_bf16" and head_dim in (64, 128) \
            and block_size % 16 == 0:
        torch.testing.assert_close(tiled.float(), rows.float(), rtol=2 ** -6, atol=2 ** -7)
    else:
        assert torch.equal(tiled, rows)


def _both(kernels, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
          starts: torch.Tensor | None = None, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's output with prompt tiles and row by row."""
    outs = []
    for tiles in (True, False):
        out = torch.empty_like(q)
        kernels.paged_attention(q, kc, vc, tables, lens, out, q.shape[-1] ** -0.5, starts, softcap, tiles=tiles)
        outs.append(out)
    return outs[0], outs[1]


STEP = [(1, 37), (70, 70), (1, 300), (60, 161), (3, 20), (1, 5)]
"""Decodes, a fresh 70-token prompt, a 60-token chunk after 101 cached positions, a 3-row verify-like run."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size",
                         [(8, 8, 64, 16), (8, 2, 128, 16), (12, 4, 64, 16), (6, 2, 48, 16), (4, 1, 64, 8)])
def test_tiles_equal_rows(kernels, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                          block_size: int) -> None:
    q, kc, vc, tables, lens = _step(STEP, heads, kv_heads, head_dim, block_size, dtype, seed=heads + head_dim)
    assert kernels.attention_prompt_tiles(tables, lens, heads, kv_heads, block_size) > 0  # tiles form
    tiled, rows = _both(kernels, q, kc, vc, tables, lens)
    _assert_tiles_match_rows(kernels, tiled, rows, head_dim, block_size)


@pytest.mark.parametrize("head_dim", [128, 64])
def test_tiles_under_windows_and_soft_caps(kernels, head_dim: int) -> None:
    """Each row of a tile has its own window start (mid-block, moving with the row); the soft cap applies first."""
    q, kc, vc, tables, lens = _step([(90, 150), (1, 40), (33, 33)], 8, 2, head_dim, 16, torch.bfloat16, seed=7)
    starts = (lens - 45).clamp(min=0).to(torch.int32)  # a 45-position window
    for softcap in (None, 2.0):
        tiled, rows = _both(kernels, q, kc, vc, tables, lens, starts, softcap)
        _assert_tiles_match_rows(kernels, tiled, rows, head_dim, 16)
    unwindowed, _ = _both(kernels, q, kc, vc, tables, lens)
    assert not torch.allclose(tiled.float(), unwindowed.float(), atol=2 ** -4)  # the windows took effect


def test_what_forms_a_tile(kernels) -> None:
    """Runs of 4 or more rows of one table with lengths rising by one form tiles (of at most 32 query vectors);
    rows of another table never join them; a step without such a run keeps every row apart."""
    count = kernels.attention_prompt_tiles
    q, kc, vc, tables, lens = _step([(20, 20), (20, 40)], 4, 4, 64, 16, torch.float32)
    assert count(tables, lens, 4, 4, 16) == 2  # each request's 20 rows: the lengths run on, the tables differ
    tiled, rows = _both(kernels, q, kc, vc, tables, lens)
    assert torch.equal(tiled, rows)
    assert count(tables, lens, 4, 1, 16) == 6  # groups of 4 heads: 8 rows a tile, 3 tiles a request
    _, _, _, tables, lens = _step([(3, 3), (1, 9), (3, 30)], 4, 4, 64, 16, torch.float32)
    assert count(tables, lens, 4, 4, 16) == 0  # speculative verifies of 3 rows beside a decode: rows


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 8, 64), (8, 2, 128), (12, 4, 64), (9, 3, 64)])
def test_amx_tiles_match_rows(heads: int, kv_heads: int, head_dim: int) -> None:
    """bf16 tiles on AMX tiles (the "amx" level): 16 vectors a tile product, partial ones zero-padded (GQA groups of
    3 and 4 make tiles of 30 and 32 vectors), chunks of 64 positions with a partial last one, online softmax
    across chunks; within the bf16 roundings of the vdpbf16ps tile, against the row path of the same library."""
    kernels = amx_kernels()
    steps = STEP + [(300, 300)]  # a long prompt: every row's max rises across chunks
    q, kc, vc, tables, lens = _step(steps, heads, kv_heads, head_dim, 16, torch.bfloat16, seed=heads + head_dim)
    tiled, rows = _both(kernels, q, kc, vc, tables, lens)
    torch.testing.assert_close(tiled.float(), rows.float(), rtol=2 ** -6, atol=2 ** -7)
    # a tile's rows differ from each other (each its own causal length): a wrong mask would show
    assert not torch.allclose(tiled[70:72].float(), tiled[71:73].float(), atol=2 ** -4)


@pytest.mark.parametrize("head_dim", [128, 64])
def test_amx_tiles_under_windows_and_soft_caps(head_dim: int) -> None:
    """Each row of an AMX tile is masked to its own window (mid-block starts) and capped first, as row by row."""
    kernels = amx_kernels()
    q, kc, vc, tables, lens = _step([(90, 150), (1, 40), (33, 33)], 8, 2, head_dim, 16, torch.bfloat16, seed=7)
    starts = (lens - 45).clamp(min=0).to(torch.int32)
    for softcap in (None, 2.0):
        tiled, rows = _both(kernels, q, kc, vc, tables, lens, starts, softcap)
        torch.testing.assert_close(tiled.float(), rows.float(), rtol=2 ** -6, atol=2 ** -7)
