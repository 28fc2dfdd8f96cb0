"""GPT-2 (``GPT2LMHeadModel``): learned absolute positions, pre-LN LayerNorm blocks, GELU-tanh MLP,
biases everywhere, the LM head tied to the token embedding.

Its checkpoints store every projection as a ``Conv1D`` weight, (in, out): transposed here on load.
The packed ``c_attn`` (q | k | v along its output) feeds the same QKV layer as Llama's q/k/v.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.attention.layer import Attention
from pagedllm.layers.activation import get_act_fn
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.models.config import ArchConfig
from pagedllm.models.weights import load_into


class PackedMHAttention(nn.Module):
    """Multi-head attention without rotary (GPT-2, OPT): one packed q | k | v projection and the output
    projection, registered under the checkpoint's names (``names``), biases as the config says."""

    names = ("qkv_proj", "out_proj")

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        qkv = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_heads, bias=cfg.qkv_bias,
                                dtype=dtype)
        heads = qkv.heads
        out = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype,
                                partition=(heads.q_start * cfg.head_dim, heads.num_heads * cfg.head_dim))
        for name, module in zip(self.names, (qkv, out)):
            setattr(self, name, module)
        self.num_heads, self.head_dim = qkv.num_heads, cfg.head_dim
        self.attn = Attention(self.num_heads, cfg.head_dim, self.num_heads, scale=cfg.head_dim ** -0.5)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        qkv_proj, out_proj = (getattr(self, name) for name in self.names)
        q, k, v = qkv_proj(hidden).chunk(3, dim=-1)
        # q, k, v (tokens, heads, head_dim)
        shape = (-1, self.num_heads, self.head_dim)
        return out_proj(self.attn(q.reshape(shape), k.reshape(shape), v.reshape(shape)))


class GPT2Attention(PackedMHAttention):
    names = ("c_attn", "c_proj")


class GPT2Block(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.attn = GPT2Attention(cfg, dtype)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.mlp = nn.Module()
        self.mlp.c_fc = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, bias=True, dtype=dtype)
        self.mlp.c_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=True, dtype=dtype)
        self.act = get_act_fn(cfg.hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden))
        return hidden + self.mlp.c_proj(self.act(self.mlp.c_fc(self.ln_2(hidden))))


class GPT2LMHeadModel(nn.Module):
    """Flat batch in (input_ids, positions: (tokens,)), hidden states out; logits on request."""

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, max_position: int) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = nn.Module()
        self.transformer.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.transformer.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size, dtype=dtype)
        self.transformer.h = nn.ModuleList(GPT2Block(cfg, dtype) for _ in range(cfg.num_layers))
        self.transformer.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype)
        self.lm_head.tie(self.transformer.wte)  # always tied in GPT-2

    supports_prompt_embeds = True
    """forward takes ``inputs_embeds`` (a prompt given as embeddings, enable_prompt_embeds)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """(tokens,) ids and positions -> (tokens, hidden); ``inputs_embeds`` (tokens, hidden): the token embeddings
        instead of the ids' (the position embeddings are added to them all the same, as transformers' GPT-2)."""
        t = self.transformer
        hidden = (t.wte(input_ids) if inputs_embeds is None else inputs_embeds) + t.wpe(positions)
        for block in t.h:
            hidden = block(hidden)
        return t.ln_f(hidden)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(tokens,) ids -> (tokens, hidden): the token embeddings (wte), the space a prompt's own are given in."""
        return self.transformer.wte(input_ids)

    def compute_logits(self, hidden: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        """(rows, hidden) -> (rows, vocab) float32 (in the model's dtype with ``keep_dtype``)."""
        return self.lm_head.compute_logits(hidden, keep_dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names, with or without the ``transformer.`` prefix; Conv1D weights (in, out) transposed."""

        def targets() -> Iterable[tuple[str, torch.Tensor, object]]:
            for name, tensor in weights:
                if name.startswith("lm_head") or name.endswith((".attn.bias", ".attn.masked_bias")):
                    continue  # the tied head; old checkpoints' causal-mask buffers
                name = name if name.startswith("transformer.") else f"transformer.{name}"
                conv = any(f".{m}.weight" in name for m in ("c_attn", "c_proj", "c_fc"))
                tensor = tensor.t() if conv else tensor  # Conv1D (in, out) -> (out, in)
                if ".c_attn." in name:  # q | k | v along the output
                    for shard, part in zip("qkv", tensor.chunk(3, dim=0)):
                        yield name, part, shard
                else:
                    yield name, tensor, None

        load_into(self, targets())
