"""Phi-3 (``Phi3ForCausalLM``): Llama's layers, but its checkpoints store q/k/v and gate/up already
packed (``qkv_proj``, ``gate_up_proj``): split on load so each rank takes its heads and columns.
LongRoPE scaling lives in layers/rotary.py."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedllm.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

        def unpacked() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if ".qkv_proj." in name:  # rows: q | k | v
                    for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv], dim=0)):
                        yield name.replace(".qkv_proj.", f".{part}."), piece
                elif ".gate_up_proj." in name:  # rows: gate | up
                    for part, piece in zip(("gate_proj", "up_proj"), tensor.chunk(2, dim=0)):
                        yield name.replace(".gate_up_proj.", f".{part}."), piece
                else:
                    yield name, tensor

        super().load_weights(unpacked())
