"""The int8 KV cache (``kv_cache_dtype="int8"``) in torch ops: its layout, the slot write that
quantizes, and the read that dequantizes blocks (the torch backend's path, and the reference the
compiled kernels, ``csrc/kv_int8.cpp``, are tested against).

A layer's cache is one int8 tensor (2, num_blocks, kv_heads, block_size * (head_dim + 2)): K then V,
each (block, KV head) one run of bytes: block_size * head_dim int8 values, then block_size float16
scales, one per slot (x ~ scale * q, scale = max |x| / 127 over the slot's head_dim values, q in
[-127, 127]). K's values are stored dim-major, (head_dim, block_size); V's as (block_size, head_dim)
token rows. Blocks stay whole runs of dim 1, so copy-on-write, swap and prefix caching move a
block's scales with its values and need nothing of their own.
"""
from __future__ import annotations

import torch

SCALE_BYTES = 2
"""One float16 scale per slot and KV head."""


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of the KV tensors for a ``kv_cache_dtype`` option."""
    return torch.int8 if kv_cache_dtype == "int8" else model_dtype


def head_block_bytes(block_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one (block, KV head) of K (or of V) in a cache of ``dtype``."""
    if dtype == torch.int8:
        return block_size * (head_dim + SCALE_BYTES)
    return block_size * head_dim * dtype.itemsize


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., head_dim) -> int8 values (..., head_dim) and float16 scales (...): one scale per row."""
    amax = x.float().abs().amax(-1, keepdim=True)  # (..., 1)
    scale = (amax / 127).clamp_(max=65504.0).to(torch.float16)  # the largest finite float16
    s = scale.float()
    q = torch.where(s > 0, x.float() / s, 0.0).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale.squeeze(-1)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """x (..., head_dim) as the int8 cache gives it back: quantized and dequantized, in x's dtype."""
    q, scale = quantize(x)
    return (q.float() * scale.float().unsqueeze(-1)).to(x.dtype)


def _regions(half: torch.Tensor, head_dim: int, key: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a K or V half (..., bs * (head_dim + 2)) as values (..., bs, head_dim) (K: a transposed
    view of its dim-major storage) and scales (..., bs) float16."""
    bs = half.shape[-1] // (head_dim + SCALE_BYTES)
    data = half[..., : bs * head_dim]
    if key:
        values = data.unflatten(-1, (head_dim, bs)).transpose(-1, -2)  # (..., bs, head_dim), dim-major storage
    else:
        values = data.unflatten(-1, (bs, head_dim))  # (..., bs, head_dim)
    scales = half[..., bs * head_dim:].view(torch.float16)  # (..., bs)
    return values, scales


def write(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_blocks: torch.Tensor,
          slot_offsets: torch.Tensor) -> None:
    """k, v (tokens, kv_heads, head_dim) quantized into their slots (block, offset) of an int8
    ``kv_cache`` (2, blocks, kv_heads, bs * (head_dim + 2))."""
    for half, x, key in ((kv_cache[0], k, True), (kv_cache[1], v, False)):
        values, scales = _regions(half, x.shape[-1], key)
        q, s = quantize(x)
        values[slot_blocks, :, slot_offsets] = q  # (tokens, kv_heads, head_dim) into their slots
        scales[slot_blocks, :, slot_offsets] = s  # (tokens, kv_heads)


def dequantize(half: torch.Tensor, head_dim: int, key: bool, dtype: torch.dtype) -> torch.Tensor:
    """Blocks of a K or V half (n, kv_heads, bs * (head_dim + 2)) -> (n, kv_heads, bs, head_dim) in ``dtype``."""
    values, scales = _regions(half, head_dim, key)
    return (values.float() * scales.float().unsqueeze(-1)).to(dtype)


def read_blocks(half: torch.Tensor, blocks: torch.Tensor, head_dim: int, key: bool, dtype: torch.dtype
                ) -> torch.Tensor:
    """Blocks ``blocks`` of one layer's K or V half (float or int8) as (n, kv_heads, bs, head_dim) in ``dtype``."""
    picked = half.index_select(0, blocks)  # whole blocks: rows of contiguous bytes gather fast
    if half.dtype != torch.int8:
        return picked  # (n, kv_heads, bs, head_dim)
    return dequantize(picked, head_dim, key, dtype)
