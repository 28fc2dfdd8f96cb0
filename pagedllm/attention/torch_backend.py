"""Paged attention in plain torch ops: the backend where no compiled kernel runs, and the reference
for every other one.

Its builder orders the step's requests decodes first. Decode tokens (one query each) are batched:
their K/V blocks are gathered through the block tables into a padded (requests, max_blocks *
block_size) view and attended with a length mask in one call. Prompt chunks are attended one request
at a time, causally over the cached prefix plus the chunk.

An int8 cache (kv_cache_dtype="int8") is written quantized and read back through ``kv_quant``: the
gathered blocks are dequantized to the query's dtype before SDPA.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedllm.attention import kv_quant
from pagedllm.attention.base import AttentionBackend, AttentionMetadataBuilder, StepInputs, always_available


@dataclass(kw_only=True)
class PrefillChunk:
    """One request's prompt chunk: its query rows and, with a cached prefix, its context blocks."""

    start: int
    end: int
    seq_len: int
    context_blocks: torch.Tensor | None
    """(blocks,) physical blocks of the whole context, or None when the chunk is the whole context."""
    mask: torch.Tensor | None
    """(query_len, seq_len) bool, True where attention is allowed; None means plain causal."""


@dataclass(kw_only=True)
class TorchAttentionMetadata:
    """One step for the torch backend: the new tokens' slots, the decode rows batched, the prompt
    chunks one by one."""

    slot_blocks: torch.Tensor
    """(num_tokens,) block of each new token's slot."""
    slot_offsets: torch.Tensor
    """(num_tokens,) offset of each new token's slot inside its block."""
    num_decodes: int
    """The first num_decodes requests (and token rows) are decodes: one query token each."""
    decode_blocks: torch.Tensor | None
    """(num_decodes * max_blocks,) int64 block ids of the decode requests, row by row (padding: 0)."""
    decode_mask: torch.Tensor | None
    """(num_decodes, 1, 1, max_blocks * block_size) bool: True for real keys."""
    prefills: list[PrefillChunk]
    _windowed: dict[int, TorchAttentionMetadata] = field(default_factory=dict)

    def windowed(self, window: int) -> TorchAttentionMetadata:
        """The same step with every query restricted to the last ``window`` positions (made once per step
        and window)."""
        if window not in self._windowed:
            decode_mask = self.decode_mask
            if decode_mask is not None:  # a decode query sits at position len - 1: keys [len - window, len)
                lens = decode_mask.sum(-1, keepdim=True)  # (nd, 1, 1, 1)
                keys = torch.arange(decode_mask.shape[-1])
                decode_mask = decode_mask & (keys >= lens - window)
            prefills = []
            for c in self.prefills:
                query_len = c.end - c.start
                # row r at position seq_len - query_len + r sees keys (p - window, p]
                pos = torch.arange(c.seq_len - query_len, c.seq_len)[:, None]
                keys = torch.arange(c.seq_len)[None, :]
                mask = (keys <= pos) & (keys > pos - window)  # (query_len, seq_len)
                prefills.append(PrefillChunk(start=c.start, end=c.end, seq_len=c.seq_len,
                                             context_blocks=c.context_blocks, mask=mask))
            self._windowed[window] = TorchAttentionMetadata(
                slot_blocks=self.slot_blocks, slot_offsets=self.slot_offsets, num_decodes=self.num_decodes,
                decode_blocks=self.decode_blocks, decode_mask=decode_mask, prefills=prefills)
        return self._windowed[window]


class TorchMetadataBuilder(AttentionMetadataBuilder):
    """Puts decode requests (one query token) first, so that one SDPA call serves all of them."""

    def order(self, num_scheduled: dict[str, int]) -> list[str]:
        return sorted(num_scheduled, key=lambda r: num_scheduled[r] != 1)  # stable: decodes first

    def build(self, step: StepInputs) -> TorchAttentionMetadata:
        bs, query_lens = step.block_size, step.query_lens
        not_decode = (query_lens != 1).nonzero()
        nd = int(not_decode[0]) if len(not_decode) else len(query_lens)
        assert bool((query_lens[nd:] != 1).all()), "decodes first: this builder's order() was not used"
        decode_blocks = decode_mask = None
        if nd:
            seq_lens = step.seq_lens[:nd].long()
            max_blocks = -(-int(seq_lens.max()) // bs)
            decode_blocks = step.block_tables[:nd, :max_blocks].long().flatten()
            decode_mask = (torch.arange(max_blocks * bs) < seq_lens.unsqueeze(1)).view(nd, 1, 1, max_blocks * bs)
        prefills = []
        qsl = step.query_start_loc.tolist()
        seq_lens_list = step.seq_lens.tolist()
        for i in range(nd, len(seq_lens_list)):
            start, end, seq_len = qsl[i], qsl[i + 1], seq_lens_list[i]
            query_len = end - start
            if query_len == seq_len:
                prefills.append(PrefillChunk(start=start, end=end, seq_len=seq_len, context_blocks=None, mask=None))
                continue
            blocks = step.block_tables[i, : -(-seq_len // bs)].long()
            # query row r sits at position seq_len - query_len + r and sees keys up to it
            mask = torch.ones(query_len, seq_len, dtype=torch.bool).tril(diagonal=seq_len - query_len)
            prefills.append(PrefillChunk(start=start, end=end, seq_len=seq_len, context_blocks=blocks, mask=mask))
        return TorchAttentionMetadata(slot_blocks=step.slot_mapping // bs, slot_offsets=step.slot_mapping % bs,
                                      num_decodes=nd, decode_blocks=decode_blocks, decode_mask=decode_mask,
                                      prefills=prefills)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    builder_cls = TorchMetadataBuilder
    is_available = staticmethod(always_available)

    supports_int8_kv = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: TorchAttentionMetadata, scale: float, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        key_cache, value_cache = self.write_kv(kv_cache, k, v, metadata)
        if kv_cache.dtype == torch.int8:  # a fresh prompt attends to what the cache holds, as every other row
            k, v = kv_quant.round_trip(k), kv_quant.round_trip(v)
        head_dim = q.shape[-1]
        # K or V of some blocks as (n, kv_heads, block_size, head_dim) in q's dtype (int8 blocks dequantized)
        read = {key: functools.partial(kv_quant.read_blocks, cache, head_dim=head_dim, key=key, dtype=q.dtype)
                for key, cache in ((True, key_cache), (False, value_cache))}
        if sliding_window is not None:
            metadata = metadata.windowed(sliding_window)
        attend = F.scaled_dot_product_attention if logits_soft_cap is None else \
            functools.partial(_capped_attention, cap=logits_soft_cap)  # SDPA has no soft cap
        out = torch.empty_like(q)
        nd = metadata.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], read[True], read[False], metadata, scale, attend)
        for chunk in metadata.prefills:
            s, e = chunk.start, chunk.end
            if chunk.context_blocks is None:  # no cached prefix: the chunk's own K/V are the context
                keys, values = k[s:e], v[s:e]
            else:
                keys = _context(read[True], chunk.context_blocks, chunk.seq_len)
                values = _context(read[False], chunk.context_blocks, chunk.seq_len)
            group = q.shape[1] // keys.shape[1]
            if group > 1:  # repeated K/V + a batch dim take SDPA's fused CPU kernel (enable_gqa falls back to math)
                keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
            mask = chunk.mask if chunk.mask is not None or logits_soft_cap is None else \
                torch.ones(e - s, chunk.seq_len, dtype=torch.bool).tril()  # the capped path takes masks only
            out[s:e] = attend(
                q[s:e].transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),  # (1, heads, len, head_dim)
                values.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=mask is None, scale=scale,
            ).squeeze(0).transpose(0, 1)  # (query_len, heads, head_dim)
        return out

    @staticmethod
    def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: TorchAttentionMetadata
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' K/V in their slots (quantized in an int8 cache); returns the (key, value) caches."""
        if kv_cache.dtype == torch.int8:
            kv_quant.write(kv_cache, k, v, metadata.slot_blocks, metadata.slot_offsets)
            return kv_cache[0], kv_cache[1]  # (num_blocks, kv_heads, block_size * (head_dim + 2)) bytes
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # (num_blocks, kv_heads, block_size, head_dim)
        key_cache[metadata.slot_blocks, :, metadata.slot_offsets] = k  # (tokens, kv_heads, head_dim) into their slots
        value_cache[metadata.slot_blocks, :, metadata.slot_offsets] = v
        return key_cache, value_cache

    @staticmethod
    def _decode(q: torch.Tensor, read_k: Callable[[torch.Tensor], torch.Tensor],
                read_v: Callable[[torch.Tensor], torch.Tensor], metadata: TorchAttentionMetadata, scale: float,
                attend: Callable[..., torch.Tensor]) -> torch.Tensor:
        nd, num_heads, head_dim = q.shape
        max_len = metadata.decode_mask.shape[-1]

        def gather(read: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
            picked = read(metadata.decode_blocks)  # (nd * blocks, kv_heads, block_size, head_dim)
            kv_heads, block_size = picked.shape[1], picked.shape[2]
            picked = picked.view(nd, max_len // block_size, kv_heads, block_size, head_dim).transpose(1, 2)
            return picked.reshape(nd, kv_heads, max_len, head_dim)  # (nd, kv_heads, max_len, head_dim)

        keys, values = gather(read_k), gather(read_v)
        # the query heads that share a KV head become that head's query rows: GQA without repeating K/V
        grouped = q.view(nd, keys.shape[1], num_heads // keys.shape[1], head_dim)  # (nd, kv_heads, group, head_dim)
        out = attend(grouped, keys, values, attn_mask=metadata.decode_mask, scale=scale)
        return out.view(nd, num_heads, head_dim)  # (nd, heads, head_dim)


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor, scale: float,
                      cap: float, is_causal: bool = False) -> torch.Tensor:
    """SDPA's arithmetic with Gemma 2's soft cap on the scores: softmax(cap * tanh(q k^T * scale / cap) + mask) v,
    in float32 at least (float64 stays float64: a test's reference). q (..., lq, d), k and v (..., lk, d), attn_mask
    broadcastable to (..., lq, lk), True: allowed."""
    assert not is_causal, "callers pass an explicit mask"
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(wide), k.to(wide).transpose(-1, -2)) * scale  # (..., lq, lk)
    scores = cap * torch.tanh(scores / cap)
    scores = scores.masked_fill(~attn_mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), v.to(wide)).to(q.dtype)


def _context(read: Callable[[torch.Tensor], torch.Tensor], blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(seq_len, kv_heads, head_dim) K or V of one sequence's first seq_len positions."""
    picked = read(blocks)  # (blocks, kv_heads, block_size, head_dim)
    return picked.transpose(0, 1).flatten(1, 2)[:, :seq_len].transpose(0, 1)  # (seq_len, kv_heads, head_dim)
