"""Split-KV decode attention (csrc/attention.h): when the (row, KV head) tasks are too few for the threads, long
tasks are cut into pieces of KV blocks whose partial results merge by log-sum-exp. With 12 threads (oversubscribed
on a small machine: these test results, not speed) the split outputs equal the unsplit ones to float tolerance at
every kernel level (the `kernels` fixture forces each), on the vdpbf16ps, FMA and scalar paths and the int8 cache,
for GQA groups, contexts that are not a multiple of the block size, sliding windows and soft caps, and batches of
one long row beside short ones; batches whose tasks cover the threads are never split."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pagedllm.attention.torch_backend import TorchAttentionBackend
from tests.attention.test_kv_int8 import int8_cache

THREADS = 12  # more than Llama-3.1-8B's 8 KV heads: its batch-1 tasks split too
# split vs unsplit differ only in the summation order of float32 sums: within a few units of the output's last place
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2 ** -7, 1e-5), torch.float16: (2 ** -9, 1e-6)}


@pytest.fixture
def threads() -> Iterator[int]:
    """torch (and so the kernels) at THREADS threads for the test."""
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield THREADS
    torch.set_num_threads(before)


def _step(lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
          int8: bool = False, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q (rows, heads, head_dim), key and value caches (blocks in random order) and block tables for rows of
    ``lens`` positions."""
    g = torch.Generator().manual_seed(seed)
    per_row = [-(-n // block_size) for n in lens]
    blocks = sum(per_row) + 1
    cache = torch.randn(TorchAttentionBackend.kv_cache_shape(blocks, block_size, kv_heads, head_dim), generator=g)
    cache = int8_cache(cache) if int8 else cache.to(dtype)
    perm = (torch.randperm(blocks - 1, generator=g) + 1).to(torch.int32)
    tables = torch.zeros(len(lens), max(per_row), dtype=torch.int32)
    used = 0
    for r, n in enumerate(per_row):
        tables[r, :n] = perm[used:used + n]
        used += n
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    return q, cache[0], cache[1], tables, torch.tensor(lens, dtype=torch.int32)


def _both(kernels, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
          starts: torch.Tensor | None = None, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's output with the automatic split and with none."""
    outs = []
    for split in (None, False):
        out = torch.empty_like(q)
        kernels.paged_attention(q, kc, vc, tables, lens, out, q.shape[-1] ** -0.5, starts, softcap, split=split)
        outs.append(out.float())
    return outs[0], outs[1]


SHAPES = [(32, 8, 128, 16), (8, 1, 128, 16), (12, 4, 64, 16), (5, 5, 64, 16), (6, 2, 48, 16), (4, 1, 64, 8)]
"""(heads, kv_heads, head_dim, block_size): Llama-3.1-8B's GQA 4 and a group of 8 at 128, groups 3 and 1 at 64 (the
dot / FMA paths), head_dim 48 (the scalar path) and blocks of 8 (the scalar path at 16 lanes)."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", SHAPES)
def test_split_matches_unsplit(kernels, threads: int, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                               block_size: int) -> None:
    for lens in ([3001], [2503, 1, 37, 300]):  # batch 1; one long row beside short ones (not block multiples)
        q, kc, vc, tables, lens_t = _step(lens, heads, kv_heads, head_dim, block_size, dtype, seed=heads + len(lens))
        assert kernels.attention_split_pieces(lens_t, kv_heads, block_size) > 0  # it splits
        split, whole = _both(kernels, q, kc, vc, tables, lens_t)
        rtol, atol = TOL[dtype]
        torch.testing.assert_close(split, whole, rtol=rtol, atol=atol)
        again, _ = _both(kernels, q, kc, vc, tables, lens_t)
        assert torch.equal(split, again)  # the plan is fixed by the lengths and threads: deterministic


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(8, 2, 128, 16), (6, 3, 64, 16), (4, 2, 48, 16),
                                                                   (4, 1, 32, 4)])
def test_split_int8_cache(kernels, threads: int, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                          block_size: int) -> None:
    """The int8 cache's kernel (csrc/kv_int8.cpp), vector and scalar paths."""
    q, kc, vc, tables, lens = _step([2011, 5, 260], heads, kv_heads, head_dim, block_size, dtype, int8=True, seed=3)
    assert kernels.attention_split_pieces(lens, kv_heads, block_size) > 0
    split, whole = _both(kernels, q, kc, vc, tables, lens)
    torch.testing.assert_close(split, whole, rtol=TOL[dtype][0], atol=TOL[dtype][1])


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("head_dim, block_size", [(128, 16), (48, 16)])
def test_split_with_window_and_soft_cap(kernels, threads: int, int8: bool, head_dim: int, block_size: int) -> None:
    """A sliding window's masked positions lie in the first piece; the soft cap applies piece by piece."""
    lens = [3001, 40, 2000]
    q, kc, vc, tables, lens_t = _step(lens, 8, 2, head_dim, block_size, torch.float32, int8=int8, seed=4)
    starts = torch.tensor([3001 - 1500, 0, 2000 - 1203], dtype=torch.int32)  # windows starting mid-block
    assert kernels.attention_split_pieces(lens_t, 2, block_size, starts) > 0
    for softcap in (None, 2.0):
        split, whole = _both(kernels, q, kc, vc, tables, lens_t, starts, softcap)
        torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-6)
    unwindowed, _ = _both(kernels, q, kc, vc, tables, lens_t)
    assert not torch.allclose(split, unwindowed, atol=1e-3)  # the window took effect


def test_when_it_splits(kernels, threads: int) -> None:
    """Few long tasks split; tasks that already cover the threads, and short contexts, do not."""
    pieces = kernels.attention_split_pieces

    def lens(*n: int) -> torch.Tensor:
        return torch.tensor(n, dtype=torch.int32)

    assert pieces(lens(32768), 1, 16) == THREADS  # one piece a thread
    assert pieces(lens(4096), 2, 16) == THREADS  # 2 tasks, a piece a thread
    assert pieces(lens(4096), 8, 16) > 0  # batch 1 of 8 KV heads on 12 threads
    assert pieces(lens(*[4096] * 3), 8, 16) == 0  # 24 tasks on 12 threads: no split
    assert pieces(lens(4096), 2, 16, split=False) == 0  # never
    assert pieces(lens(100), 1, 16) == 0 and pieces(lens(100), 1, 16, split=True) == 0  # too short to cut
    assert pieces(lens(16000, *[50] * 15), 2, 16) > 0  # one long row among 32 tasks: its tasks are cut
    torch.set_num_threads(8)
    assert pieces(lens(4096), 8, 16, split=True) == 0  # 8 equal tasks on 8 threads: split=True cuts only to balance
    torch.set_num_threads(1)
    assert pieces(lens(32768), 1, 16) == 0  # one thread: nothing to share


def test_batched_decode_unchanged(kernels, threads: int) -> None:
    """Tasks that cover the threads take the unsplit path: the automatic mode's output is the unsplit one, bit
    for bit."""
    lens = [600 + 11 * r for r in range(16)]  # 32 tasks of similar length on 12 threads
    q, kc, vc, tables, lens = _step(lens, 8, 2, 128, 16, torch.bfloat16, seed=5)
    assert kernels.attention_split_pieces(lens, 2, 16) == 0
    split, whole = _both(kernels, q, kc, vc, tables, lens)
    assert torch.equal(split, whole)
