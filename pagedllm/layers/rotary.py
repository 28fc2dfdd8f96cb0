"""Rotary position embedding (neox / rotate-half layout, as HF Llama), with rope scaling."""
from __future__ import annotations

import math
from typing import Any

import torch

from pagedllm.errors import ValidationError
from pagedllm.layers.custom_op import CustomOp


def _inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,) for the rope type in ``scaling``."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "freq_factors":  # GGUF's rope_freqs tensor: one divisor per frequency
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32)
    raise ValidationError(f"rope scaling type {rope_type!r} is not supported (default, linear, llama3, longrope)",
                          param="rope_scaling", value=scaling)


def _longrope_angles(head_dim: int, max_position: int, base: float, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: (angles (max_position, head_dim / 2), attention factor). Positions below the
    pretrained length use the short factors, the others the long ones (per position, so cached keys
    never change; a sequence that fits the pretrained length gets exactly transformers' values)."""
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or s["max_position_embeddings"] / original
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    positions = torch.arange(max_position, dtype=torch.float32)
    short = torch.outer(positions, 1.0 / (torch.tensor(s["short_factor"], dtype=torch.float32) * base ** exponent))
    long = torch.outer(positions, 1.0 / (torch.tensor(s["long_factor"], dtype=torch.float32) * base ** exponent))
    return torch.where((positions < original)[:, None], short, long), attention


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by factor, short kept, the band between smoothed."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(CustomOp):
    """Applies rotary embedding to q and k at given positions from a precomputed cos/sin cache. ``forward`` takes
    the packed qkv rows: ``forward_cpu`` rotates them in place where the kernels run, else ``forward_native``
    (layers/custom_op.py); ``rotate`` turns separate q and k (torch ops)."""

    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: dict[str, Any] | None, dtype: torch.dtype) -> None:
        super().__init__(dtype)  # the cos/sin cache below is in dtype: the kernels read it as it is
        self.head_dim = head_dim
        scale = 1.0
        device = torch.get_default_device()
        # A shapes-only model (the meta device: worker/memory_fit.py) gets its table computed on the CPU and moved:
        # arange on the meta device runs torch's Python reference, whose first call imports torch._dynamo (~1 s).
        with torch.device("cpu" if device.type == "meta" else device):
            if (scaling or {}).get("rope_type", (scaling or {}).get("type")) == "longrope":
                freqs, scale = _longrope_angles(head_dim, max_position, base, scaling)
            else:
                freqs = torch.outer(torch.arange(max_position, dtype=torch.float32),
                                    _inv_freq(head_dim, base, scaling))
            emb = torch.cat((freqs, freqs), dim=-1)  # (max_pos, head_dim)
        # Cached in the run dtype: transformers casts cos/sin to the activations' dtype too.
        self.register_buffer("cos_cache", (emb.cos() * scale).to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin_cache", (emb.sin() * scale).to(device=device, dtype=dtype), persistent=False)
        self._positions: torch.Tensor | None = None
        self._cos = self._sin = torch.empty(0)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q (tokens, heads, head_dim), k (tokens, kv_heads, head_dim) -> rotated copies."""
        if positions is not self._positions:  # one module serves every layer: gather cos/sin once per step
            self._positions = positions
            self._cos = self.cos_cache[positions].unsqueeze(1)  # (tokens, 1, head_dim)
            self._sin = self.sin_cache[positions].unsqueeze(1)  # (tokens, 1, head_dim)
        cos, sin = self._cos, self._sin
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin

    def _split(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.head_dim
        q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
        # q (tokens, heads, head_dim); k, v (tokens, kv_heads, head_dim)
        return q.view(-1, num_heads, d), k.view(-1, num_kv_heads, d), v.view(-1, num_kv_heads, d)

    def forward_native(self, positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, num_kv_heads: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Packed (tokens, (heads + 2 kv_heads) * head_dim) -> rotated q, rotated k, v as
        (tokens, heads, head_dim) tensors (v a view of qkv)."""
        q, k, v = self._split(qkv, num_heads, num_kv_heads)
        q, k = self.rotate(positions, q, k)
        return q, k, v

    def forward_cpu(self, positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, num_kv_heads: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As ``forward_native``, q and k rotated in place inside ``qkv`` (all three returned as views of it);
        strided rows: the native path."""
        if qkv.dim() != 2 or qkv.stride(-1) != 1:
            return self.forward_native(positions, qkv, num_heads, num_kv_heads)
        self.kernels.rotary_inplace(positions, qkv, self.cos_cache, self.sin_cache, num_heads, num_kv_heads,
                                    self.head_dim)
        return self._split(qkv, num_heads, num_kv_heads)  # views of qkv, rotated in place
