"""Random paged-attention steps for the backend tests: decodes, prompt chunks, scattered blocks."""
from __future__ import annotations

import torch

from pagedllm.attention.base import StepInputs


def make_step(seq_lens: list[int], prefill: int, block_size: int, num_blocks: int, seed: int,
           chunks: list[tuple[int, int]] | None = None) -> StepInputs:
    """Decodes (one query each) then one prompt chunk of ``prefill`` tokens after 7 cached ones (or
    the given (query_len, seq_len) chunks); blocks scattered."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    chunks = chunks if chunks is not None else ([(prefill, prefill + 7)] if prefill else [])
    lens = seq_lens + [n for _, n in chunks]
    max_blocks = max(-(-n // block_size) for n in lens)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        k = -(-n // block_size)
        tables[i, :k] = perm[used:used + k].to(torch.int32)
        used += k
    query_lens = [1] * len(seq_lens) + [q for q, _ in chunks]
    positions = torch.cat([torch.arange(n - q, n) for n, q in zip(lens, query_lens)])
    rows = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(query_lens))
    slots = tables[rows, positions // block_size].long() * block_size + positions % block_size
    qsl = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    return StepInputs(req_ids=[str(i) for i in range(len(lens))], input_ids=torch.zeros_like(positions),
                      positions=positions, query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32),
                      block_tables=tables, slot_mapping=slots, block_size=block_size, sample_rows=[],
                      logits_indices=torch.zeros(0, dtype=torch.int64))
