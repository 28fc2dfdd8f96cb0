"""Mixture-of-experts MLPs: a router picks top-k experts per token; the experts' weights are stacked
and each expert runs once per step on all the tokens routed to it (token-grouped, one loop over
experts, never over tokens). Tensor parallelism splits every expert's intermediate size, so each
rank computes a partial sum of every expert's output and one all-reduce finishes the layer.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.ops import tensor_model_parallel_all_reduce
from pagedllm.distributed.parallel_state import get_tp_rank, get_tp_world_size, split_evenly
from pagedllm.layers.activation import SiluAndMul


def expert_gemm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (rows, in) @ weight (out_features, in)^T, into ``out`` if given: the experts' matmuls (a module-level
    name, so benchmarks/moe_step.py can time them apart)."""
    return torch.matmul(x, weight.T, out=out)


class FusedExperts(nn.Module):
    """Every expert's [gate; up] (w13) and down (w2) projections, stacked along a leading expert axis."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 dtype: torch.dtype, renormalize: bool) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.start, self.size = split_evenly(intermediate_size, get_tp_world_size(), get_tp_rank())
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.size, hidden_size, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.size, dtype=dtype), requires_grad=False)
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader
        self.act = SiluAndMul()  # [gate | up] -> silu(gate) * up, fused where the CPU kernels run

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object) -> None:
        """Copy this rank's slice of one expert's "gate", "up" or "down" matrix (shard_id: (expert, part))."""
        expert, part = shard_id
        if part == "down":  # (hidden, intermediate): this rank's columns
            param.data[expert].copy_(loaded.narrow(1, self.start, self.size))
        else:  # (intermediate, hidden): this rank's rows, gate first then up
            param.data[expert].narrow(0, 0 if part == "gate" else self.size, self.size).copy_(
                loaded.narrow(0, self.start, self.size))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x (tokens, hidden), router_logits (tokens, experts) -> (tokens, hidden): the weighted sum of
        each token's top-k experts."""
        probs = router_logits.float().softmax(-1)
        weights, experts = probs.topk(self.top_k, dim=-1)  # (tokens, k) each
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        flat = experts.flatten()  # (tokens * k,) expert of each assignment, token-major
        order = flat.argsort(stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host read per layer
        token_of = order // self.top_k  # the token of each grouped assignment
        # one gather, one scale and one scatter for all experts; each expert works on a slice (a view):
        # per expert only its two GEMMs and the SiLU (measured: routing was ~as costly as the GEMMs)
        grouped = x.index_select(0, token_of)  # (tokens * k, hidden), rows grouped by expert
        ys = torch.empty_like(grouped)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                end = start + count
                h = self.act(expert_gemm(grouped[start:end], self.w13[expert]))  # (count, size)
                expert_gemm(h, self.w2[expert], out=ys[start:end])  # (count, hidden), written in place
                start = end
        ys.mul_(weights.flatten()[order].to(x.dtype).unsqueeze(1))  # each assignment's routing weight
        out = torch.zeros_like(x).index_add_(0, token_of, ys)
        return tensor_model_parallel_all_reduce(out)


class MoEBlock(nn.Module):
    """A router (replicated: small) and the experts: Mixtral's block_sparse_moe."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 renormalize: bool = True) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, dtype=dtype)
        self.experts = FusedExperts(num_experts, top_k, hidden_size, intermediate_size, dtype, renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))
