"""Triton kernels of the triton attention backend: K/V into their cache slots, and paged attention
over a flat varlen batch (prompt chunks, decode tokens and mixed batches in one launch), with a
split-K variant for decode steps whose few sequences have long contexts.

Cache layout (attention/base.py): (2, num_blocks, kv_heads, block_size, head_dim). A program
of the varlen kernel serves one (request, block of query tokens) work item and one KV head: its
rows are (query token, query head of that KV head's group) pairs, at least 16 of them (tl.dot's
minimum), masked where they do not exist. Keys stream block by block through the block table
with an online softmax in float32.

Runs compiled on CUDA, and on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1),
which is how the tests check it against the torch backend.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm import envs


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_c_kv, stride_c_b, stride_c_h, stride_c_t,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr):
    """Program (token, kv head): copy k/v[token, head] into its slot (slot < 0: padding, skipped)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        d = tl.arange(0, HEAD_DIM_P2)
        dmask = d < HEAD_DIM
        k = tl.load(k_ptr + token * stride_kt + head * stride_kh + d, mask=dmask)
        v = tl.load(v_ptr + token * stride_vt + head * stride_vh + d, mask=dmask)
        dst = cache_ptr + block * stride_c_b + head * stride_c_h + offset * stride_c_t + d
        tl.store(dst, k, mask=dmask)
        tl.store(dst + stride_c_kv, v, mask=dmask)


@triton.jit
def _attend_blocks(q, acc, m_i, l_i, cache_ptr, table_ptr, kv_head, first_block, last_block,
                   row_pos, row_valid, seq_len, scale, window, softcap,
                   stride_c_kv, stride_c_b, stride_c_h, stride_c_t,
                   BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
                   PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    """Online softmax over KV blocks [first_block, last_block) of one sequence: the running row
    maxima m_i, sums l_i and weighted values acc (all float32) after them; with ``window`` > 0 a row
    at position p sees keys p - window + 1 .. p only; ``softcap`` > 0 caps the scores. ``DOT_F32``:
    both dots in float32 (the interpreter's half-precision tl.dot multiplies raw bits)."""
    t = tl.arange(0, BLOCK_SIZE)
    d = tl.arange(0, HEAD_DIM_P2)
    dmask = d < HEAD_DIM
    for j in range(first_block, last_block):
        block = tl.load(table_ptr + j).to(tl.int64)
        base = cache_ptr + block * stride_c_b + kv_head * stride_c_h + t[:, None] * stride_c_t + d[None, :]
        k = tl.load(base, mask=dmask[None, :], other=0.0)  # (BLOCK_SIZE, HEAD_DIM_P2)
        v = tl.load(base + stride_c_kv, mask=dmask[None, :], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_M, BLOCK_SIZE) float32
        cap = tl.where(softcap > 0, softcap, 1.0)
        s = tl.where(softcap > 0, cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0), s)  # cap * tanh(s / cap) (Gemma 2)
        key_pos = j * BLOCK_SIZE + t
        allowed = row_valid[:, None] & (key_pos[None, :] < seq_len) & (key_pos[None, :] <= row_pos[:, None])
        allowed = allowed & ((window <= 0) | (key_pos[None, :] > row_pos[:, None] - window))  # sliding window
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: no NaN from -inf - -inf
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _varlen_kernel(q_ptr, out_ptr, cache_ptr, tables_ptr, seq_lens_ptr, qsl_ptr, work_req_ptr, work_qblock_ptr,
                   scale, window, softcap, stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
                   stride_c_kv, stride_c_b, stride_c_h, stride_c_t,
                   GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
                   PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    """Program (work item, kv head): BLOCK_M // GROUP_P2 query tokens of one request, all GROUP
    query heads of the KV head, causal over the cached prefix and the chunk."""
    work = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(work_req_ptr + work)
    q_block = tl.load(work_qblock_ptr + work)
    q_start = tl.load(qsl_ptr + req)
    query_len = tl.load(qsl_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_P2
    rows = tl.arange(0, BLOCK_M)
    token = q_block * BLOCK_Q + rows // GROUP_P2  # within the request's chunk
    head_in_group = rows % GROUP_P2
    row_valid = (token < query_len) & (head_in_group < GROUP)
    head = kv_head * GROUP + head_in_group
    d = tl.arange(0, HEAD_DIM_P2)
    dmask = d < HEAD_DIM
    q_rows = (q_start + token).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_valid[:, None] & dmask[None, :], other=0.0)  # (BLOCK_M, HEAD_DIM_P2)
    if DOT_F32:
        q = q.to(tl.float32)
    row_pos = context_len + token  # each row's position: it sees keys 0 .. row_pos
    last_pos = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)  # keys this program needs
    num_blocks = (last_pos + BLOCK_SIZE - 1) // BLOCK_SIZE
    acc = tl.zeros((BLOCK_M, HEAD_DIM_P2), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    # with a window, blocks wholly before the first row's window are skipped (window 0: from block 0)
    first_window_pos = tl.maximum(context_len + q_block * BLOCK_Q - window + 1, 0)
    first_block = (window > 0).to(tl.int32) * (first_window_pos // BLOCK_SIZE)
    acc, m_i, l_i = _attend_blocks(q, acc, m_i, l_i, cache_ptr, tables_ptr + req * stride_table, kv_head, first_block,
                                   num_blocks, row_pos, row_valid, seq_len, scale, window, softcap,
                                   stride_c_kv, stride_c_b, stride_c_h, stride_c_t,
                                   BLOCK_SIZE, HEAD_DIM, HEAD_DIM_P2, PRECISION, DOT_F32)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dmask[None, :])


@triton.jit
def _split_decode_kernel(q_ptr, part_acc_ptr, part_ml_ptr, cache_ptr, tables_ptr, seq_lens_ptr, scale, window, softcap,
                         stride_qt, stride_qh, stride_table, stride_c_kv, stride_c_b, stride_c_h, stride_c_t,
                         NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
                         PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    """Program (request, kv head, split): one decode token's GROUP heads over 1/NUM_SPLITS of its
    KV blocks; writes the split's unnormalized acc, row max and sum (float32)."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < GROUP
    head = kv_head * GROUP + rows
    d = tl.arange(0, HEAD_DIM_P2)
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + req.to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_valid[:, None] & dmask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    total_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    # with a window, only its blocks are split between the programs (window 0: all of them)
    start_block = (window > 0).to(tl.int32) * (tl.maximum(seq_len - window, 0) // BLOCK_SIZE)
    per_split = (total_blocks - start_block + NUM_SPLITS - 1) // NUM_SPLITS
    first = start_block + split * per_split
    last = tl.minimum(first + per_split, total_blocks)
    acc = tl.zeros((BLOCK_M, HEAD_DIM_P2), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    row_pos = tl.zeros((BLOCK_M,), dtype=tl.int32) + seq_len - 1  # the decode token sees every key
    acc, m_i, l_i = _attend_blocks(q, acc, m_i, l_i, cache_ptr, tables_ptr + req * stride_table, kv_head, first,
                                   last, row_pos, row_valid, seq_len, scale, window, softcap,
                                   stride_c_kv, stride_c_b, stride_c_h, stride_c_t,
                                   BLOCK_SIZE, HEAD_DIM, HEAD_DIM_P2, PRECISION, DOT_F32)
    # partials laid out (request, head, split, ...): (num_reqs, heads, NUM_SPLITS, HEAD_DIM_P2) and (.., 2)
    slot = (req.to(tl.int64) * (tl.num_programs(1) * GROUP) + head) * NUM_SPLITS + split
    tl.store(part_acc_ptr + slot[:, None] * HEAD_DIM_P2 + d[None, :], acc, mask=row_valid[:, None])
    tl.store(part_ml_ptr + slot * 2, m_i, mask=row_valid)
    tl.store(part_ml_ptr + slot * 2 + 1, l_i, mask=row_valid)


@triton.jit
def _split_reduce_kernel(part_acc_ptr, part_ml_ptr, out_ptr, stride_ot, stride_oh,
                         NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr):
    """Program (request, head): combine the splits' partial softmaxes into the output row."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM_P2)
    slot = (req.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS + s
    m = tl.load(part_ml_ptr + slot * 2)
    l_i = tl.load(part_ml_ptr + slot * 2 + 1)
    acc = tl.load(part_acc_ptr + slot[:, None] * HEAD_DIM_P2 + d[None, :])  # (NUM_SPLITS, HEAD_DIM_P2)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))  # empty splits weigh nothing
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_i * w, 0)
    tl.store(out_ptr + req.to(tl.int64) * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def _p2(n: int) -> int:
    return triton.next_power_of_2(n)


def _interpreted() -> bool:
    return envs.TRITON_INTERPRET.read()


def _precision(dtype: torch.dtype) -> str | None:
    """float32 stays IEEE (tf32 would cost 1e-3); half types multiply natively, accumulate in float32."""
    return "ieee" if dtype == torch.float32 or _interpreted() else None


def store_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v (tokens, kv_heads, head_dim) into their slots of kv_cache (2, blocks, kv_heads, block_size, head_dim)."""
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    _store_kv_kernel[(tokens, kv_heads)](
        k, v, kv_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        BLOCK_SIZE=kv_cache.shape[3], HEAD_DIM=head_dim, HEAD_DIM_P2=_p2(head_dim))


def varlen_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, work_req: torch.Tensor, work_qblock: torch.Tensor,
                     block_q: int, scale: float, out: torch.Tensor, window: int = 0,
                     softcap: float = 0.0) -> torch.Tensor:
    """Paged attention of every query row (q (tokens, heads, head_dim)) into ``out``.

    ``work_req``/``work_qblock``: one entry per (request, block of ``block_q`` query tokens);
    ``window`` > 0: a sliding window of that many positions; ``softcap`` > 0: scores capped (Gemma 2)."""
    _, heads, head_dim = q.shape
    kv_heads = kv_cache.shape[2]
    group = heads // kv_heads
    block_m = max(16, _p2(group) * block_q)
    assert block_m // _p2(group) == block_q, "block_q must be block_m // next_pow2(group)"
    _varlen_kernel[(work_req.numel(), kv_heads)](
        q, out, kv_cache, block_tables, seq_lens, query_start_loc, work_req, work_qblock, scale, window, softcap,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        GROUP=group, GROUP_P2=_p2(group), BLOCK_M=block_m, BLOCK_SIZE=kv_cache.shape[3], HEAD_DIM=head_dim,
        HEAD_DIM_P2=_p2(head_dim), PRECISION=_precision(q.dtype), DOT_F32=_interpreted())
    return out


def block_q_for(num_heads: int, num_kv_heads: int) -> int:
    """Query tokens per program of the varlen kernel (rows = tokens x next_pow2(group) >= 16)."""
    return max(16, _p2(num_heads // num_kv_heads)) // _p2(num_heads // num_kv_heads)


def split_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, num_splits: int, scale: float, out: torch.Tensor,
                           window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Decode-only steps (one query token per request, q (reqs, heads, head_dim)): each request's KV
    blocks split ``num_splits`` ways (a power of 2) across programs, then one reduction."""
    reqs, heads, head_dim = q.shape
    kv_heads = kv_cache.shape[2]
    group = heads // kv_heads
    hd = _p2(head_dim)
    part_acc = torch.empty(reqs, heads, num_splits, hd, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(reqs, heads, num_splits, 2, dtype=torch.float32, device=q.device)
    _split_decode_kernel[(reqs, kv_heads, num_splits)](
        q, part_acc, part_ml, kv_cache, block_tables, seq_lens, scale, window, softcap,
        q.stride(0), q.stride(1), block_tables.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_SPLITS=num_splits, GROUP=group, BLOCK_M=max(16, _p2(group)), BLOCK_SIZE=kv_cache.shape[3],
        HEAD_DIM=head_dim, HEAD_DIM_P2=hd, PRECISION=_precision(q.dtype), DOT_F32=_interpreted())
    _split_reduce_kernel[(reqs, heads)](part_acc, part_ml, out, out.stride(0), out.stride(1),
                                        NUM_SPLITS=num_splits, HEAD_DIM=head_dim, HEAD_DIM_P2=hd)
    return out
