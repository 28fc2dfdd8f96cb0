"""Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2's attention (qkv bias); in the layers the config names, a
mixture of experts plus an always-on shared expert scaled by its own sigmoid gate; dense MLPs in the
others (``mlp_only_layers``, ``decoder_sparse_step``)."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.moe import MoEBlock
from pagedllm.models.config import ArchConfig
from pagedllm.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel


class Qwen2MoeSparseBlock(MoEBlock):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size, dtype,
                         renormalize=cfg.norm_topk_prob)
        self.shared_expert = LlamaMLP(cfg, dtype, cfg.shared_expert_intermediate_size) \
            if cfg.shared_expert_intermediate_size else None
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False, dtype=dtype) \
            if cfg.shared_expert_intermediate_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class Qwen2MoeModel(LlamaModel):
    @staticmethod
    def make_mlp(cfg: ArchConfig, dtype: torch.dtype, index: int) -> nn.Module | None:
        return Qwen2MoeSparseBlock(cfg, dtype) if index in cfg.moe_layers else None


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    model_cls = Qwen2MoeModel
    supported_lora_modules = ("qkv_proj", "o_proj")
    """Adapters on the attention projections (not on the experts)."""
    supports_cuda_graphs = False
    """The experts' loop reads each expert's token count back to the host: not capturable."""
