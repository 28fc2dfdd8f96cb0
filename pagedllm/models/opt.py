"""OPT (``OPTForCausalLM``), the paper's model family: learned positions with OPT's offset of 2,
LayerNorm before (most sizes) or after (opt-350m) each block, ReLU MLP, biases, and for opt-350m
embeddings narrower than the hidden size (projected in before the first layer and out after the
last). The LM head is tied to the token embedding.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.layers.activation import get_act_fn
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.models.config import ArchConfig
from pagedllm.models.gpt2 import PackedMHAttention
from pagedllm.models.weights import load_into

POSITION_OFFSET = 2
"""OPT's learned position table starts 2 rows in (a fairseq leftover): position p reads row p + 2."""

_PACKED = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}


class OPTAttention(PackedMHAttention):
    names = ("qkv_proj", "out_proj")


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm_before = cfg.norm_before
        self.self_attn = OPTAttention(cfg, dtype)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype)
        self.fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype)
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.act = get_act_fn(cfg.hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        pre = self.norm_before
        out = self.self_attn(self.self_attn_layer_norm(hidden) if pre else hidden)
        hidden = hidden + out if pre else self.self_attn_layer_norm(hidden + out)
        out = self.fc2(self.act(self.fc1(self.final_layer_norm(hidden) if pre else hidden)))
        return hidden + out if pre else self.final_layer_norm(hidden + out)


class OPTDecoder(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        width = cfg.word_embed_proj_dim or cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, width, dtype)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + POSITION_OFFSET, cfg.hidden_size,
                                            dtype=dtype)
        if cfg.word_embed_proj_dim is not None:
            # small and replicated on every rank (a column-parallel split would leave each rank a slice)
            self.project_in = nn.Linear(width, cfg.hidden_size, bias=False, dtype=dtype)
            self.project_out = nn.Linear(cfg.hidden_size, width, bias=False, dtype=dtype)
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        if cfg.final_norm:
            self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if hasattr(self, "project_in"):
            hidden = self.project_in(hidden)
        hidden = hidden + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            hidden = layer(hidden)
        if hasattr(self, "final_layer_norm"):
            hidden = self.final_layer_norm(hidden)
        return self.project_out(hidden) if hasattr(self, "project_out") else hidden


class OPTForCausalLM(nn.Module):
    """Flat batch in (input_ids, positions: (tokens,)), hidden states out; logits on request."""

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, max_position: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.decoder = OPTDecoder(cfg, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.word_embed_proj_dim or cfg.hidden_size, dtype)
        self.lm_head.tie(self.model.decoder.embed_tokens)

    supports_prompt_embeds = True
    """forward takes ``inputs_embeds`` (a prompt given as embeddings, enable_prompt_embeds)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """(tokens,) ids and positions -> (tokens, hidden); ``inputs_embeds`` (tokens, word_embed_proj_dim or
        hidden): the token embeddings instead of the ids' (projected in and given position embeddings all the same,
        as transformers' OPT)."""
        return self.model.decoder(input_ids, positions, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(tokens,) ids -> the token embeddings (embed_tokens, before project_in): a prompt's own are given so."""
        return self.model.decoder.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        """(rows, hidden) -> (rows, vocab) float32 (in the model's dtype with ``keep_dtype``)."""
        return self.lm_head.compute_logits(hidden, keep_dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names, with or without the ``model.`` prefix; q/k/v packed into one projection."""

        def targets() -> Iterable[tuple[str, torch.Tensor, object]]:
            for name, tensor in weights:
                if name.startswith("lm_head"):
                    continue  # tied to the embedding
                name = name if name.startswith("model.") else f"model.{name}"
                shard = None
                for part, shard_id in _PACKED.items():
                    if f".{part}." in name:
                        name, shard = name.replace(f".{part}.", ".qkv_proj."), shard_id
                yield name, tensor, shard

        load_into(self, targets())
