"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral with its sliding window, Qwen2 with qkv bias, Qwen3
with q/k norms).

HF module names; Q/K/V and gate/up are packed into one matmul each and loaded through a small
name mapping.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.attention.layer import Attention
from pagedllm.distributed.parallel_state import get_pp_stage
from pagedllm.distributed.pipeline import recv_from_previous_stage, send_to_next_stage
from pagedllm.layers.activation import GeluAndMul, SiluAndMul
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.config import ArchConfig
from pagedllm.models.cpu_stack import CpuDecoderStack
from pagedllm.models.pipeline import PPMissingLayer
from pagedllm.models.weights import load_into

# checkpoint name part -> (packed module name part, shard id)
_PACKED = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
# one expert's matrix of a mixture-of-experts block -> the stacked parameter (layers/moe.py) and its part
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def _target(name: str) -> tuple[str, object]:
    """(our parameter name, shard id) of a checkpoint tensor."""
    expert = _EXPERT.match(name)
    if expert is not None:
        part = _EXPERT_PART[expert[3]]
        return f"{expert[1]}.{'w2' if part == 'down' else 'w13'}", (int(expert[2]), part)
    for part, (packed, shard_id) in _PACKED.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{packed}."), shard_id
    return name, None


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, dtype: torch.dtype, index: int = 0) -> None:
        """``index``: the layer's index (its sliding window, where layers differ)."""
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          bias=cfg.qkv_bias, dtype=dtype)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        heads = self.qkv_proj.heads  # o_proj reads exactly the attention output of this rank's query heads
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype,
                                        partition=(heads.q_start * cfg.head_dim, heads.num_heads * cfg.head_dim))
        self.rotary_emb = rotary
        self.attn = Attention(self.num_heads, cfg.head_dim, self.num_kv_heads, scale=cfg.attention_scale,
                              sliding_window=cfg.window_of(index), logits_soft_cap=cfg.attn_logit_softcapping)
        if cfg.qk_norm:  # Qwen3: each head of q and k normalised (over head_dim) before the rotary embedding
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        if hasattr(self, "q_norm"):
            d = self.head_dim
            q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
            q = self.q_norm(q.reshape(-1, d)).view(-1, self.num_heads, d)  # (tokens * heads, d) -> (tokens, heads, d)
            k = self.k_norm(k.reshape(-1, d)).view(-1, self.num_kv_heads, d)
            q, k = self.rotary_emb.rotate(positions, q, k)
            return self.o_proj(self.attn(q, k, v.reshape(-1, self.num_kv_heads, d)))  # v (tokens, kv_heads, d)
        # q (tokens, heads, head_dim); k, v (tokens, kv_heads, head_dim); q and k rotated
        q, k, v = self.rotary_emb(positions, qkv, self.num_heads, self.num_kv_heads)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, intermediate_size: int | None = None) -> None:
        super().__init__()
        size = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [size, size], bias=cfg.mlp_bias, dtype=dtype)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype)
        self.act_fn = SiluAndMul() if cfg.hidden_act == "silu" else GeluAndMul()  # GeGLU: Gemma

    def process_weights_after_loading(self) -> None:
        """Fuse silu(gate) * up into the gate_up GEMM where our bf16 GEMM serves (layers/prepack.py)."""
        if isinstance(self.act_fn, SiluAndMul):
            self.gate_up_proj.pack_for_silu_and_mul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.gate_up_proj.silu_and_mul(x)  # (tokens, intermediate), or None
        return self.down_proj(fused if fused is not None else self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    mlp_name = "mlp"
    """The checkpoint's name of the feed-forward block (Mixtral: block_sparse_moe)."""

    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, dtype: torch.dtype, mlp: nn.Module | None = None,
                 index: int = 0) -> None:
        """``mlp``: the feed-forward block (default: the dense gated MLP); ``index``: the layer's index."""
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, dtype, index)
        setattr(self, self.mlp_name, mlp if mlp is not None else LlamaMLP(cfg, dtype))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return getattr(self, self.mlp_name)(hidden), residual


class LlamaModel(nn.Module):
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, max_position: int) -> None:
        """At pipeline_parallel_size > 1, only this stage's layers (models/pipeline.py)."""
        super().__init__()
        self.stage = stage = get_pp_stage()
        first, last = stage is None or stage.is_first, stage is None or stage.is_last
        start, end = (0, cfg.num_layers) if stage is None else (stage.start, stage.end)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype) if first else \
            PPMissingLayer()
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, dtype)
        self.layers = nn.ModuleList(self.layer_cls(cfg, rotary, dtype, self.make_mlp(cfg, dtype, index), index)
                                    if start <= index < end else PPMissingLayer() for index in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if last else PPMissingLayer()
        self.width, self.dtype = cfg.hidden_size, dtype
        # False: not built yet (weights and caches come later); a stage runs its layers one by one
        self._stack: CpuDecoderStack | None | bool = False if stage is None else None

    def caches_bound(self) -> None:
        """The KV caches were (re)allocated (start-up, a wake-up after sleep): the compiled stack, which holds their
        addresses, is built again at the next forward (never one that writes into a freed pool)."""
        self._stack = False

    @staticmethod
    def make_mlp(cfg: ArchConfig, dtype: torch.dtype, index: int) -> nn.Module | None:
        """Layer ``index``'s feed-forward block; None: the dense gated MLP (mixture-of-experts models override)."""
        return None

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(tokens,) ids -> (tokens, hidden): what the first layer takes (a prompt's own embeddings replace rows)."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if self.stage is not None:
            return self._stage_forward(input_ids, positions, inputs_embeds)
        if self._stack is False:
            self._stack = CpuDecoderStack.build(self)
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        if self._stack is not None and self._stack.usable(hidden, positions):
            return self._stack.run(hidden, positions)  # every layer in one compiled call
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def _stage_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        """This pipeline stage's layers: from the embeddings (the first stage) or the previous stage's hidden
        states and residual; to the next stage (what is returned then is not used), or through the final norm
        (the last stage)."""
        stage = self.stage
        if stage.is_first:
            hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            hidden, residual = recv_from_previous_stage(positions.shape[0], self.width, self.dtype)
        for layer in self.layers[stage.start:stage.end]:
            hidden, residual = layer(positions, hidden, residual)
        if not stage.is_last:
            send_to_next_stage(hidden, residual)
            return hidden
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Flat batch in (input_ids, positions: (tokens,)), hidden states out; logits on request."""

    model_cls: type[LlamaModel] = LlamaModel

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, max_position: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.model_cls(cfg, dtype, max(max_position, cfg.max_position_embeddings))
        self.stage = stage = get_pp_stage()
        # a pipeline's last stage holds the head alone: a tied one is loaded from the embedding table's tensor
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype) if stage is None or stage.is_last \
            else PPMissingLayer()
        if cfg.tie_word_embeddings and stage is None:
            self.lm_head.tie(self.model.embed_tokens)

    supports_prompt_embeds = True
    """forward takes ``inputs_embeds`` (a prompt given as embeddings, enable_prompt_embeds)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """(tokens,) ids and positions -> (tokens, hidden); ``inputs_embeds`` (tokens, hidden): the first layer's
        input instead of the ids' embeddings (``embed_input_ids``)."""
        return self.model(input_ids, positions, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(tokens,) ids -> (tokens, hidden), the embeddings forward would start from (scaled where the model
        scales them): a prompt's own embeddings are given in this space."""
        return self.model.embed_input_ids(input_ids)

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    """Packed layer -> the checkpoint modules in it, in row order (LoRA adapters name the latter)."""
    supported_lora_modules = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    """The linear layers LoRA adapters may change."""

    def compute_logits(self, hidden: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        """(rows, hidden) -> (rows, vocab) float32 (in the model's dtype with ``keep_dtype``)."""
        return self.lm_head.compute_logits(hidden, keep_dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; every parameter must be filled exactly once."""
        tied = self.config.tie_word_embeddings
        head_of_stage = tied and self.stage is not None and self.stage.is_last

        def targets() -> Iterable[tuple[str, torch.Tensor, object]]:
            for name, tensor in weights:
                if "rotary_emb.inv_freq" in name or (name.startswith("lm_head") and tied):
                    continue
                if head_of_stage and name == "model.embed_tokens.weight":
                    name = "lm_head.weight"  # (the table itself is the first stage's)
                target, shard = _target(name)
                yield target, tensor, shard

        load_into(self, targets(), may_be_missing=["lm_head.weight"] if tied and not head_of_stage else [])


class LlamaForSequenceClassification(nn.Module):
    """A Llama-family decoder with a classification head (``score``: hidden -> num_labels, no bias) read at each
    input's last token: reward models and decoder classifiers (Llama, Qwen2/3, Mistral ...ForSequenceClassification)."""

    default_pooling_type = "LAST"

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, max_position: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, dtype, max(max_position, cfg.max_position_embeddings))
        self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(tokens,) ids and positions -> (tokens, hidden)."""
        return self.model(input_ids, positions)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """(sequences, hidden) last-token states -> (sequences, num_labels) logits."""
        return self.score(pooled)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors: the decoder's and ``score.weight``."""
        def targets() -> Iterable[tuple[str, torch.Tensor, object]]:
            for name, tensor in weights:
                if "rotary_emb.inv_freq" in name or name.startswith("lm_head"):
                    continue
                target, shard = _target(name)
                yield target, tensor, shard

        load_into(self, targets())
