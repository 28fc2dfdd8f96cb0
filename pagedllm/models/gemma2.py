"""Gemma 2 and 3 (``Gemma2ForCausalLM``, text-only ``Gemma3ForCausalLM``): Llama's attention with a
sliding window on some layers (every other one; Gemma 3: five of six, with their own rope base),
scores scaled by ``query_pre_attn_scalar`` (and soft-capped: Gemma 2), q/k norms per head (Gemma 3),
four norms per layer (their weights stored as offsets from 1), a GeGLU MLP, embeddings scaled by
sqrt(hidden) and soft-capped output logits (Gemma 2).
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.embedding import VocabParallelEmbedding
from pagedllm.layers.norm import GemmaRMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.config import ArchConfig
from pagedllm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, dtype, index)
        if cfg.qk_norm:  # Gemma 3: the per-head norms are Gemma's (1 + w) ones
            self.self_attn.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
            self.self_attn.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(cfg, dtype)
        norm = lambda: GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(hidden)))
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class Gemma2Model(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        # the scale rounded to the run dtype first, as transformers does (sqrt(3072) is 55.5 in bf16)
        self.register_buffer("normalizer", torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype), persistent=False)
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, dtype)
        local = rotary if cfg.local_rope_theta is None else \
            RotaryEmbedding(cfg.head_dim, max_position, cfg.local_rope_theta, None, dtype)  # Gemma 3's sliding layers
        self.layers = nn.ModuleList(Gemma2DecoderLayer(cfg, local if cfg.window_of(i) else rotary, dtype, i)
                                    for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(tokens,) ids -> (tokens, hidden), scaled as the first layer takes them."""
        return self.embed_tokens(input_ids) * self.normalizer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class Gemma2ForCausalLM(LlamaForCausalLM):
    model_cls = Gemma2Model
    supported_lora_modules = ()
    """No LoRA for Gemma yet (enable_lora is refused)."""

    def compute_logits(self, hidden: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        """(rows, hidden) -> (rows, vocab), capped as c * tanh(logits / c)."""
        logits = self.lm_head.compute_logits(hidden, keep_dtype=True)
        cap = self.config.final_logit_softcapping
        capped = logits.float() if cap is None else cap * torch.tanh(logits.float() / cap)
        return capped.to(logits.dtype) if keep_dtype else capped
