"""Paged attention in plain torch ops: the CPU backend and the reference for every other one.

Decode tokens (one query each) are batched: their K/V are gathered through the block table
into a padded (requests, max_len) view and attended with a length mask in one call. Prompt
chunks are attended one request at a time, causally over the cached prefix plus the chunk.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.attention.base import AttentionBackend, CommonAttentionMetadata


@dataclass
class PrefillChunk:
    """One request's prompt chunk: its query rows and the cache slots of its whole context."""

    start: int
    end: int
    context_slots: torch.Tensor | None
    """(seq_len,) slots of every key, or None when the chunk is the whole context (no prefix)."""
    mask: torch.Tensor | None
    """(query_len, seq_len) bool, True where attention is allowed; None means plain causal."""


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_slots: torch.Tensor | None
    """(num_decodes, max_len) cache slot of every key position (padding: slot 0)."""
    decode_mask: torch.Tensor | None
    """(num_decodes, 1, 1, max_len) bool: True for real keys."""
    prefills: list[PrefillChunk]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        nd, bs = common.num_decodes, common.block_size
        decode_slots = decode_mask = None
        if nd:
            seq_lens = common.seq_lens[:nd].long()
            max_len = int(seq_lens.max())
            tables = common.block_tables[:nd, : -(-max_len // bs)].long()
            # (nd, blocks, 1) * bs + (bs,) -> (nd, blocks * bs): every slot of each table, in order
            decode_slots = (tables.unsqueeze(-1) * bs + torch.arange(bs)).flatten(1)[:, :max_len]
            decode_mask = (torch.arange(max_len) < seq_lens.unsqueeze(1)).view(nd, 1, 1, max_len)
        prefills = []
        qsl = common.query_start_loc.tolist()
        seq_lens_list = common.seq_lens.tolist()
        for i in range(nd, len(seq_lens_list)):
            start, end, seq_len = qsl[i], qsl[i + 1], seq_lens_list[i]
            query_len = end - start
            if query_len == seq_len:
                prefills.append(PrefillChunk(start, end, None, None))
                continue
            table = common.block_tables[i, : -(-seq_len // bs)].long()
            slots = (table.unsqueeze(-1) * bs + torch.arange(bs)).flatten()[:seq_len]  # (seq_len,)
            # query row r sits at position seq_len - query_len + r and sees keys up to it
            mask = torch.ones(query_len, seq_len, dtype=torch.bool).tril(diagonal=seq_len - query_len)
            prefills.append(PrefillChunk(start, end, slots, mask))
        return TorchAttentionMetadata(common.slot_mapping, nd, decode_slots, decode_mask, prefills)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: TorchAttentionMetadata, scale: float) -> torch.Tensor:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)  # (num_blocks * block_size, kv_heads, head_dim)
        value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
        key_cache.index_copy_(0, metadata.slot_mapping, k)
        value_cache.index_copy_(0, metadata.slot_mapping, v)
        out = torch.empty_like(q)
        nd = metadata.num_decodes
        if nd:
            keys = key_cache[metadata.decode_slots].transpose(1, 2)  # (nd, kv_heads, max_len, head_dim)
            values = value_cache[metadata.decode_slots].transpose(1, 2)
            out[:nd] = F.scaled_dot_product_attention(
                q[:nd].unsqueeze(2), keys, values, attn_mask=metadata.decode_mask, scale=scale,
                enable_gqa=True).squeeze(2)  # (nd, heads, 1, head_dim) -> (nd, heads, head_dim)
        for chunk in metadata.prefills:
            s, e = chunk.start, chunk.end
            if chunk.context_slots is None:  # no cached prefix: the chunk's own K/V are the context
                keys, values = k[s:e], v[s:e]
            else:
                keys, values = key_cache[chunk.context_slots], value_cache[chunk.context_slots]
            out[s:e] = F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),  # (heads, len, head_dim)
                attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scale, enable_gqa=True,
            ).transpose(0, 1)  # (query_len, heads, head_dim)
        return out
