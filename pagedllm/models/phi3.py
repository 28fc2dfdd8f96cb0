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
                # narrow, not split: a GGUF file's quantized rows (layers/quant.py) slice the same way
                if ".qkv_proj." in name:  # rows: q | k | v
                    for part, start, rows in (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)):
                        yield name.replace(".qkv_proj.", f".{part}."), tensor.narrow(0, start, rows)
                elif ".gate_up_proj." in name:  # rows: gate | up
                    half = tensor.shape[0] // 2
                    for part, start in (("gate_proj", 0), ("up_proj", half)):
                        yield name.replace(".gate_up_proj.", f".{part}."), tensor.narrow(0, start, half)
                else:
                    yield name, tensor

        super().load_weights(unpacked())
