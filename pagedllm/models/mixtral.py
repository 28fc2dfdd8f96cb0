"""Mixtral (``MixtralForCausalLM``): Llama's attention with a mixture of experts in every layer
(``block_sparse_moe``: a router and top-k of the experts, their weights renormalised)."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.moe import MoEBlock
from pagedllm.models.config import ArchConfig
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class MixtralDecoderLayer(LlamaDecoderLayer):
    mlp_name = "block_sparse_moe"


class MixtralModel(LlamaModel):
    layer_cls = MixtralDecoderLayer

    @staticmethod
    def make_mlp(cfg: ArchConfig, dtype: torch.dtype, index: int) -> nn.Module | None:
        return MoEBlock(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size, dtype)


class MixtralForCausalLM(LlamaForCausalLM):
    model_cls = MixtralModel
    supported_lora_modules = ("qkv_proj", "o_proj")
    """Adapters on the attention projections (not on the experts)."""
    supports_cuda_graphs = False
    """The experts' loop reads each expert's token count back to the host: not capturable."""
