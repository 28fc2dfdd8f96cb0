"""Paged attention in Triton kernels (attention/triton_ops.py): one launch stores the step's K/V,
one serves every query row of the step — prompt chunks, decode tokens, mixed batches — and
decode-only steps with few, long sequences split each sequence's KV blocks across programs.

The builder keeps the scheduler's order (the kernel needs none) and lists the step's work items:
one per (request, block of query tokens). Runs on CUDA, and on CPU under Triton's interpreter
(``TRITON_INTERPRET=1``: slow, for tests). ``"auto"`` never picks it on a CPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm import envs
from pagedllm.attention.base import AttentionBackend, AttentionMetadataBuilder, StepInputs, triton_available

SPLITS_ENV = envs.TRITON_DECODE_SPLITS.name
"""Force the split count of decode-only steps (a power of 2; 1 turns split-K off)."""
TARGET_PROGRAMS = 256
"""Split-K aims at about this many programs per decode step (2 per SM of an H100/H200)."""
MIN_BLOCKS_PER_SPLIT = 8


@dataclass(kw_only=True)
class TritonAttentionMetadata:
    """One step for the triton backend (int32 / int64 tensors; moved to the device once per step)."""

    slot_mapping: torch.Tensor
    """(num_tokens,) int64 cache slot of each new token."""
    block_tables: torch.Tensor
    """(num_reqs, max_blocks) int32."""
    seq_lens: torch.Tensor
    """(num_reqs,) int32 context length after this step."""
    query_start_loc: torch.Tensor
    """(num_reqs + 1,) int32."""
    query_lens: list[int]
    max_seq_len: int
    _work: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _device: torch.device | None = None
    forced_splits: int | None = None
    """PAGEDLLM_TRITON_DECODE_SPLITS, as read when the builder was made (None: chosen per step)."""

    @property
    def decode_only(self) -> bool:
        return max(self.query_lens) == 1

    def on(self, device: torch.device) -> TritonAttentionMetadata:
        """The step's tensors on ``device`` (copied once, by the first layer)."""
        if self._device != device:
            for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
                setattr(self, name, getattr(self, name).to(device, non_blocking=True))
            self._work = {bq: (r.to(device), b.to(device)) for bq, (r, b) in self._work.items()}
            self._device = device
        return self

    def work_items(self, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(request, query block) of every program of the varlen kernel at ``block_q`` tokens per program."""
        if block_q not in self._work:
            counts = -(-torch.tensor(self.query_lens) // block_q)  # (reqs,) programs per request
            reqs = torch.repeat_interleave(torch.arange(len(counts)), counts)  # (work items,)
            first = torch.cumsum(counts, 0) - counts  # each request's first work item
            qblocks = torch.arange(len(reqs)) - first[reqs]
            device = self._device or torch.device("cpu")
            self._work[block_q] = (reqs.to(torch.int32).to(device), qblocks.to(torch.int32).to(device))
        return self._work[block_q]

    def num_splits(self, num_kv_heads: int, block_size: int) -> int:
        """Splits per sequence for a decode-only step: enough programs to fill the GPU, each with at
        least MIN_BLOCKS_PER_SPLIT blocks; 1 (no split) otherwise."""
        if self.forced_splits is not None:
            return self.forced_splits
        programs = len(self.query_lens) * num_kv_heads
        blocks = -(-self.max_seq_len // block_size)
        splits = 1
        while splits * 2 * programs <= TARGET_PROGRAMS and blocks >= splits * 2 * MIN_BLOCKS_PER_SPLIT:
            splits *= 2
        return splits


class TritonMetadataBuilder(AttentionMetadataBuilder):
    """The scheduler's order; the step's layout as the kernels read it."""

    def __init__(self) -> None:
        self.forced_splits = envs.TRITON_DECODE_SPLITS.read()  # read once, when the model's builder is made

    def build(self, step: StepInputs) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(
            slot_mapping=step.slot_mapping, block_tables=step.block_tables.to(torch.int32).contiguous(),
            seq_lens=step.seq_lens.to(torch.int32), query_start_loc=step.query_start_loc.to(torch.int32),
            query_lens=step.query_lens.tolist(), max_seq_len=int(step.seq_lens.max()),
            forced_splits=self.forced_splits)

    def build_for_graph(self, step: StepInputs, max_seq_len: int) -> TritonAttentionMetadata:
        # the static buffers already have the kernels' dtypes and live on the device: no copy, so a
        # replay reads what was written into them; the split count is fixed for the longest context
        return TritonAttentionMetadata(
            slot_mapping=step.slot_mapping, block_tables=step.block_tables, seq_lens=step.seq_lens,
            query_start_loc=step.query_start_loc, query_lens=[1] * len(step.req_ids), max_seq_len=max_seq_len,
            _device=step.seq_lens.device, forced_splits=self.forced_splits)


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    builder_cls = TritonMetadataBuilder
    supports_cuda_graphs = True
    is_available = staticmethod(triton_available)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: TritonAttentionMetadata, scale: float, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        from pagedllm.attention import triton_ops  # imports triton: only when this backend runs
        md = metadata.on(q.device)
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # kernels step head_dim by 1
        triton_ops.store_kv(kv_cache, k, v, md.slot_mapping)
        out = torch.empty_like(q)
        num_kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[3]
        if md.decode_only:
            splits = md.num_splits(num_kv_heads, block_size)
            if splits > 1:
                return triton_ops.split_decode_attention(q, kv_cache, md.block_tables, md.seq_lens, splits, scale, out,
                                                         sliding_window or 0, logits_soft_cap or 0.0)
        block_q = triton_ops.block_q_for(q.shape[1], num_kv_heads)
        work_req, work_qblock = md.work_items(block_q)
        return triton_ops.varlen_attention(q, kv_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                                           work_req, work_qblock, block_q, scale, out, sliding_window or 0,
                                           logits_soft_cap or 0.0)
