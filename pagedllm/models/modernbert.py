"""ModernBERT encoders for embeddings and sequence classification: token embeddings and a LayerNorm (no position
table: rotary positions), pre-LN blocks (the first block reads the normed embeddings as they are) of
bidirectional attention and a GeGLU MLP, and a final LayerNorm.

Every ``global_attn_every_n_layers``-th layer (layer 0 first) attends over the whole sequence with rotary base
``rope_theta``; the others only over tokens within ``local_attention // 2`` positions, with base
``local_rope_theta``. As models/bert.py: the runner hands in whole sequences one after the other (``seq_lens``),
no KV cache, and ``forward`` returns the final-normed hidden states (transformers' ``last_hidden_state``).
Checkpoint names are transformers'; a classifier keeps its encoder under ``model.`` (a bare encoder checkpoint
has no prefix: both load either way).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagedllm.attention.encoder import EncoderAttention
from pagedllm.layers.activation import get_act_fn
from pagedllm.layers.embedding import VocabParallelEmbedding
from pagedllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.bert import pad_step
from pagedllm.models.config import ArchConfig
from pagedllm.models.weights import load_into

_SKIPPED = ("head.", "decoder.")  # a masked-LM checkpoint's prediction head: an embedder reads the encoder only


def _layer_norm(cfg: ArchConfig, dtype: torch.dtype) -> nn.LayerNorm:
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, bias=cfg.norm_bias, dtype=dtype)


def _is_global(cfg: ArchConfig, layer: int) -> bool:
    return not cfg.layer_types or cfg.layer_types[layer] != "sliding_attention"


class ModernBertAttention(nn.Module):
    """Packed q | k | v projection (``Wqkv``), rotary positions, (windowed) bidirectional attention, ``Wo``."""

    def __init__(self, cfg: ArchConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.attn = EncoderAttention(cfg.num_heads, cfg.head_dim, cfg.head_dim ** -0.5,
                                     None if _is_global(cfg, layer) else cfg.local_attention // 2, dtype)
        self.Wqkv = ColumnParallelLinear(cfg.hidden_size, 3 * cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias,
                                         dtype=dtype)
        self.Wo = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, seq_lens: list[int],
                rotary: RotaryEmbedding) -> torch.Tensor:
        # (tokens, 3 * heads * d) -> q, k, v (tokens, heads, d), q and k rotated
        q, k, v = rotary(positions, self.Wqkv(hidden), self.num_heads, self.num_heads)
        out = self.attn(q, k, v, seq_lens)
        return self.Wo(out.reshape(-1, self.num_heads * self.head_dim))


class ModernBertMLP(nn.Module):
    """GeGLU: ``Wi`` gives the input and the gate halves; act(input) * gate goes through ``Wo``."""

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.Wi = ColumnParallelLinear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype)
        self.Wo = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype)
        self.act = get_act_fn(cfg.hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        value, gate = self.Wi(hidden).chunk(2, dim=-1)
        return self.Wo(self.act(value) * gate)


class ModernBertLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.is_global = _is_global(cfg, layer)
        # the embeddings' LayerNorm already normed the first layer's input
        self.attn_norm = nn.Identity() if layer == 0 else _layer_norm(cfg, dtype)
        self.attn = ModernBertAttention(cfg, layer, dtype)
        self.mlp_norm = _layer_norm(cfg, dtype)
        self.mlp = ModernBertMLP(cfg, dtype)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, seq_lens: list[int],
                rotary: RotaryEmbedding) -> torch.Tensor:
        hidden = hidden + self.attn(self.attn_norm(hidden), positions, seq_lens, rotary)
        return hidden + self.mlp(self.mlp_norm(hidden))


class ModernBertModel(nn.Module):
    """The encoder: flat batch of whole sequences in, final-normed hidden states out."""

    is_encoder_only = True
    """The runner gives whole sequences and their lengths: no KV cache, no forward context."""
    default_pooling_type = "CLS"
    """What a classifier head reads (embedders' pooling comes from their sentence-transformers config)."""

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, max_position: int) -> None:
        """``max_position``: the longest input the engine runs (the rotary tables' rows)."""
        super().__init__()
        self.config = cfg
        self.embeddings = nn.Module()
        self.embeddings.tok_embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.embeddings.norm = _layer_norm(cfg, dtype)
        self.layers = nn.ModuleList(ModernBertLayer(cfg, i, dtype) for i in range(cfg.num_layers))
        self.final_norm = _layer_norm(cfg, dtype)
        # one table per rope base, shared by the layers that use it (global: scaled as the config says)
        self.global_rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, dtype)
        local_theta = cfg.local_rope_theta if cfg.local_rope_theta is not None else cfg.rope_theta
        self.local_rotary = RotaryEmbedding(cfg.head_dim, max_position, local_theta, None, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int],
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(tokens,) ids and positions (0.. within each sequence) of sequences of ``seq_lens`` tokens, one after
        the other -> (tokens, hidden). ModernBERT has no token types: ``token_type_ids`` is ignored."""
        tokens = input_ids.shape[0]
        rows = self.layers[0].attn.Wqkv.rows_for(tokens) if len(self.layers) else tokens
        input_ids, positions, _, seq_lens = pad_step(rows, input_ids, positions, None, seq_lens)
        hidden = self.embeddings.norm(self.embeddings.tok_embeddings(input_ids))
        for layer in self.layers:
            hidden = layer(hidden, positions, seq_lens, self.global_rotary if layer.is_global else self.local_rotary)
        return self.final_norm(hidden[:tokens])

    def checkpoint_targets(self, weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor, object]]:
        """(our parameter name, tensor, shard id) of each checkpoint tensor this encoder holds (``model.``
        prefix or none); a masked-LM head's are skipped."""
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if not name.startswith(_SKIPPED):
                yield name, tensor, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """transformers' names, with or without the ``model.`` prefix; every parameter filled."""
        load_into(self, self.checkpoint_targets(weights))


class ModernBertForSequenceClassification(nn.Module):
    """A ModernBERT classifier / cross-encoder: the encoder, then the head (dense, activation, LayerNorm) over
    the pooled state (the first token's, or with ``classifier_pooling`` "mean" the mean of all), then
    ``classifier``."""

    is_encoder_only = True
    default_pooling_type = "CLS"

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, max_position: int) -> None:
        super().__init__()
        from pagedllm.errors import ValidationError

        assert cfg.num_labels > 0, "a sequence classifier's config names its labels"
        if cfg.classifier_pooling not in ("cls", "mean"):
            raise ValidationError.bad_value("classifier_pooling", cfg.classifier_pooling, "'cls' or 'mean'")
        self.config = cfg
        if cfg.classifier_pooling == "mean":
            self.default_pooling_type = "MEAN"  # the runner's pooler reads it: the mean of the whole sequence
        self.model = ModernBertModel(cfg, dtype, max_position)
        self.head = nn.Module()
        self.head.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.classifier_bias, dtype=dtype)
        self.head.act = get_act_fn(cfg.classifier_activation)
        self.head.norm = _layer_norm(cfg, dtype)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int],
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """As ``ModernBertModel.forward``: (tokens, hidden)."""
        return self.model(input_ids, positions, seq_lens)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """(sequences, hidden) pooled states -> (sequences, num_labels) float32 logits."""
        head = self.head
        return self.classifier(head.norm(head.act(head.dense(pooled)))).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """transformers' names: the head's ``head.*`` and ``classifier.*``, the encoder's ``model.*`` (or
        unprefixed)."""

        def targets() -> Iterator[tuple[str, torch.Tensor, object]]:
            for name, tensor in weights:
                if name.startswith(("head.", "classifier.")):
                    yield name, tensor, None
                else:
                    yield f"model.{name.removeprefix('model.')}", tensor, None

        load_into(self, targets())
