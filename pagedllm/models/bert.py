"""BERT-family encoders (BERT, RoBERTa, XLM-R) for embeddings and cross-encoders: word + token type + learned
position embeddings, post-LN blocks of bidirectional attention and an exact-GELU MLP, biases everywhere.

The runner hands in whole sequences, one after the other without padding (``seq_lens``): no KV cache, no
forward context. ``forward`` returns the last layer's hidden states; a classifier's ``classify`` turns each
sequence's first-token state into logits. Checkpoint names are transformers' (with or without the ``bert.`` /
``roberta.`` prefix of task-head and some sentence-transformers checkpoints); q / k / v are packed into one
projection. RoBERTa's positions start at pad_token_id + 1 (``ArchConfig.position_offset``): the model adds it.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagedllm.attention.encoder import EncoderAttention
from pagedllm.layers.activation import get_act_fn
from pagedllm.layers.embedding import VocabParallelEmbedding
from pagedllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.norm import LayerNorm
from pagedllm.models.config import ArchConfig
from pagedllm.models.weights import load_into

_QKV = {"query": "q", "key": "k", "value": "v"}
_SKIPPED = ("cls.", "lm_head.")  # masked-LM / next-sentence heads: an embedder reads the encoder only
_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")  # old checkpoints saved these buffers


def pad_step(rows: int, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None,
             seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int]]:
    """An encoder step's inputs with one more sequence, of padding, up to ``rows`` tokens: the row count its
    matmuls compute anyway (``rows_for`` of a linear layer: oneDNN's cached shapes). They then take every
    activation as it is, where each would have copied it into a padded buffer (~9% of all-MiniLM's op time at
    ~2,000 tokens a step). The caller keeps the first ``input_ids.shape[0]`` rows of its output."""
    extra = rows - input_ids.shape[0]
    if extra <= 0:
        return input_ids, positions, token_type_ids, seq_lens
    input_ids = torch.nn.functional.pad(input_ids, (0, extra))
    positions = torch.cat([positions, torch.arange(extra, device=positions.device)])
    if token_type_ids is not None:
        token_type_ids = torch.nn.functional.pad(token_type_ids, (0, extra))
    return input_ids, positions, token_type_ids, [*seq_lens, extra]


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.offset = cfg.position_offset
        self.word_embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(max(cfg.type_vocab_size, 1), cfg.hidden_size, dtype=dtype)
        self.LayerNorm = LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids)
        types = self.token_type_embeddings.weight[0] if token_type_ids is None else \
            self.token_type_embeddings(token_type_ids)
        hidden = hidden + types + self.position_embeddings(positions + self.offset if self.offset else positions)
        return self.LayerNorm(hidden)


class BertAttention(nn.Module):
    """Self-attention (q | k | v packed) and its output projection, the residual add and LayerNorm."""

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_heads, bias=True,
                                          dtype=dtype)
        heads = self.qkv_proj.heads
        self.num_heads, self.head_dim = heads.num_heads, cfg.head_dim
        self.attn = EncoderAttention(self.num_heads, cfg.head_dim, cfg.head_dim ** -0.5, dtype=dtype)
        self.output = nn.Module()
        self.output.dense = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, bias=True, dtype=dtype,
                                              partition=(heads.q_start * cfg.head_dim, heads.num_heads * cfg.head_dim))
        self.output.LayerNorm = LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)

    def forward(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).chunk(3, dim=-1)
        shape = (-1, self.num_heads, self.head_dim)  # (tokens, heads * d) -> (tokens, heads, d)
        out = self.attn(q.view(shape), k.view(shape), v.view(shape), seq_lens)
        out = self.output.dense(out.reshape(-1, self.num_heads * self.head_dim))  # (tokens, heads * d) in
        return self.output.LayerNorm(out, hidden)


class BertLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention = BertAttention(cfg, dtype)
        self.intermediate = nn.Module()
        self.intermediate.dense = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, bias=True,
                                                       dtype=dtype)
        self.output = nn.Module()
        self.output.dense = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=True, dtype=dtype)
        self.output.LayerNorm = LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.act = get_act_fn(cfg.hidden_act)

    def forward(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        hidden = self.attention(hidden, seq_lens)
        return self.output.LayerNorm(self.output.dense(self.act(self.intermediate.dense(hidden))), hidden)


class BertModel(nn.Module):
    """The encoder: flat batch of whole sequences in, last layer's hidden states out (transformers'
    ``last_hidden_state``). With ``pooler`` (the BERT classifier's) it also holds ``pooler.dense``."""

    is_encoder_only = True
    """The runner gives whole sequences and their lengths: no KV cache, no forward context."""
    default_pooling_type = "CLS"
    """The state a classifier head reads (embedders' pooling comes from their sentence-transformers config)."""

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, max_position: int, *, pooler: bool = False) -> None:
        """``max_position``: the longest input the engine runs (at most the position table's rows less the
        offset)."""
        super().__init__()
        assert max_position + cfg.position_offset <= cfg.max_position_embeddings, (max_position, cfg)
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg, dtype)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(BertLayer(cfg, dtype) for _ in range(cfg.num_layers))
        if pooler:
            self.pooler = nn.Module()
            self.pooler.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, dtype=dtype)  # small: replicated

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int],
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(tokens,) ids, positions (0.. within each sequence) and token types (None: all 0) of sequences of
        ``seq_lens`` tokens, one after the other -> (tokens, hidden)."""
        tokens = input_ids.shape[0]
        rows = self.encoder.layer[0].attention.qkv_proj.rows_for(tokens) if len(self.encoder.layer) else tokens
        input_ids, positions, token_type_ids, seq_lens = pad_step(rows, input_ids, positions, token_type_ids,
                                                                  seq_lens)
        hidden = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            hidden = layer(hidden, seq_lens)
        return hidden[:tokens]

    def checkpoint_targets(self, weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor, object]]:
        """(our parameter name, tensor, shard id) of each checkpoint tensor this encoder holds; the rest (a
        task head's, a masked-LM head's, saved buffers, a pooler we do not keep) are skipped."""
        for name, tensor in weights:
            for prefix in ("bert.", "roberta."):
                name = name.removeprefix(prefix)
            name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
            if name.startswith(_SKIPPED) or name in _BUFFERS or (name.startswith("pooler.")
                                                                  and not hasattr(self, "pooler")):
                continue
            shard = None
            for part, shard_id in _QKV.items():
                if f".attention.self.{part}." in name:
                    name, shard = name.replace(f".attention.self.{part}.", ".attention.qkv_proj."), shard_id
            yield name, tensor, shard

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """transformers' names, with or without the ``bert.`` / ``roberta.`` prefix; every parameter filled."""
        load_into(self, self.checkpoint_targets(weights))


class RobertaModel(BertModel):
    """RoBERTa and XLM-R: BERT's encoder; positions offset by pad_token_id + 1, one token type."""


class BertForSequenceClassification(nn.Module):
    """A BERT cross-encoder / classifier: the encoder with its pooler, then ``classifier``."""

    is_encoder_only = True
    default_pooling_type = "CLS"
    encoder_name = "bert"
    """The checkpoint's prefix of the encoder's tensors."""

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, max_position: int) -> None:
        super().__init__()
        assert cfg.num_labels > 0, "a sequence classifier's config names its labels"
        self.config = cfg
        setattr(self, self.encoder_name, self.make_encoder(cfg, dtype, max_position))
        self.make_head(cfg, dtype)

    def make_encoder(self, cfg: ArchConfig, dtype: torch.dtype, max_position: int) -> BertModel:
        return BertModel(cfg, dtype, max_position, pooler=True)

    def make_head(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int],
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """As ``BertModel.forward``: (tokens, hidden)."""
        return getattr(self, self.encoder_name)(input_ids, positions, seq_lens, token_type_ids)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """(sequences, hidden) first-token states -> (sequences, num_labels) float32 logits."""
        pooler = getattr(self, self.encoder_name).pooler
        return self.classifier(torch.tanh(pooler.dense(pooled))).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """transformers' names: the head's ``classifier.*``, the encoder's with its prefix (or without)."""
        encoder: BertModel = getattr(self, self.encoder_name)

        def targets() -> Iterator[tuple[str, torch.Tensor, object]]:
            for name, tensor in weights:
                if name.startswith("classifier."):
                    yield name, tensor, None
                    continue
                for target, part, shard in encoder.checkpoint_targets([(name, tensor)]):
                    yield f"{self.encoder_name}.{target}", part, shard

        load_into(self, targets())


class RobertaForSequenceClassification(BertForSequenceClassification):
    """A RoBERTa / XLM-R cross-encoder: no pooler; ``classifier`` is dense + tanh + out_proj on the first token."""

    encoder_name = "roberta"

    def make_encoder(self, cfg: ArchConfig, dtype: torch.dtype, max_position: int) -> BertModel:
        return RobertaModel(cfg, dtype, max_position)

    def make_head(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        self.classifier = nn.Module()
        self.classifier.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, dtype=dtype)
        self.classifier.out_proj = nn.Linear(cfg.hidden_size, cfg.num_labels, dtype=dtype)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        head = self.classifier
        return head.out_proj(torch.tanh(head.dense(pooled))).float()
