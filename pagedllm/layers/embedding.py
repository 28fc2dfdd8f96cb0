"""Vocabulary-parallel token embedding and LM head (each rank holds a slice of the vocabulary).

Every rank holds ``ceil(vocab / tp)`` rows so the gathered logits line up; the last rank's rows
past the vocabulary are zero padding, cut off after the gather.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.ops import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from pagedllm.distributed.parallel_state import get_tp_rank, get_tp_world_size
from pagedllm.layers.prepack import PackedWeight, can_prepack, matmul_for, prepack
from pagedllm.layers.quant import QuantWeight, kept_quantized, store_rows


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (token ids) are split across ranks; the lookups are summed."""

    quant: QuantWeight | None = None
    """The table's rows kept in their GGUF format (quantization="gguf" where the kernels run), else None."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        self.num_embeddings = num_embeddings
        self.rows_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_partition
        # rows of this slice that are real tokens (the rest is padding, zero)
        self.num_real_rows = max(0, min(self.rows_per_partition, num_embeddings - self.vocab_start))
        # empty, not zeros: pages the checkpoint fills are first touched by its copy (zeros would make the whole
        # table resident at construction, and an LM head tied afterwards would have held a table for nothing)
        self.weight = nn.Parameter(torch.empty(self.rows_per_partition, embedding_dim, dtype=dtype),
                                   requires_grad=False)
        self.weight.data[self.num_real_rows:].zero_()  # the padding rows no checkpoint fills
        self.weight.weight_loader = self.weight_loader
        self.weight.takes_quantized = True

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """Copy this rank's rows of the full embedding matrix."""
        assert loaded.shape[0] == self.num_embeddings, (loaded.shape, self.num_embeddings)
        store_rows(param, loaded.narrow(0, self.vocab_start, self.num_real_rows))

    def process_weights_after_loading(self) -> None:
        """Keep the quantized rows where the kernels run (a lookup decodes its rows), else dequantize."""
        self.quant = kept_quantized(self.weight)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return F.embedding(ids, self.weight)
        kernels = self.quant.kernels  # the ones that packed the rows at load
        assert kernels is not None and len(self.quant.pieces) == 1
        rows = kernels.qrows(self.quant.pieces[0], ids.reshape(-1), self.weight.dtype)  # (ids, hidden)
        return rows.view(*ids.shape, rows.shape[-1])  # (..., hidden)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_partition)
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0)  # other ranks hold these rows
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary; each rank computes its slice of the logits."""

    packed_weight: PackedWeight | None = None
    tied = False
    """Its weight is the embedding table's (``tie``)."""

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding table's weight (tied word embeddings)."""
        self.weight = embedding.weight
        self.tied = True

    def process_weights_after_loading(self) -> None:
        """Keep quantized rows for the quantized kernels (shared with a tied embedding table), or pack the CPU
        weight for our GEMM or oneDNN (layers/prepack.py); then the plain weight stays only when tied (it is
        the embedding table): an untied one is dropped (Llama-3-8B's is 1 GiB in bf16)."""
        super().process_weights_after_loading()
        if self.quant is None and can_prepack(self.weight):
            self.packed_weight = prepack(self.weight)
            if not self.tied:
                self.weight.data = torch.empty(0, dtype=self.weight.dtype)  # the packed copy replaces it
        matmul = matmul_for(self.packed_weight, self.quant)
        if matmul is not None:  # bound once: compute_logits asks nothing about the weight's form
            self._matmul = matmul

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T over the plain weight (with tied embeddings: the embedding table)."""
        return F.linear(x, self.weight, bias)

    def compute_logits(self, hidden_states: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        """(tokens, hidden) -> (tokens, vocab) logits in float32, or in the weights' dtype with
        ``keep_dtype`` (the sampler reads bf16 directly: no float32 copy of a (256, 49k) array)."""
        local = self._matmul(hidden_states)
        logits = tensor_model_parallel_all_gather(local, dim=-1)
        if logits.shape[-1] != self.num_embeddings:  # the padding rows of the last rank
            logits = logits[:, :self.num_embeddings].contiguous()
        return logits if keep_dtype else logits.float()
