"""The Attention layer models use: reshapes, then defers to the step's backend."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.context import get_forward_context


class Attention(nn.Module):
    """Paged attention over this layer's KV cache (bound by the model runner)."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None) -> None:
        """``sliding_window``: each query attends to the last this many positions only (None: all);
        ``logits_soft_cap``: scores capped as c * tanh(s / c) (Gemma 2)."""
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads, self.scale = num_heads, head_dim, num_kv_heads, scale
        self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap
        self.kv_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (tokens, heads, head_dim), k/v (tokens, kv_heads, head_dim) -> (tokens, heads * head_dim)."""
        assert self.kv_cache is not None, "the model runner binds KV caches before the first forward"
        ctx = get_forward_context()
        out = ctx.backend.forward(q, k, v, self.kv_cache, ctx.metadata, self.scale, self.sliding_window,
                                  self.logits_soft_cap)
        return out.reshape(-1, self.num_heads * self.head_dim)  # (tokens, heads * head_dim)
