"""CUDA graphs for decode-only steps: the model's forward pass captured once per batch size of a
ladder at start-up and replayed, so a decode step costs one graph launch instead of a few
hundred kernel launches from Python.

A graph reads and writes fixed addresses, so each step's inputs are copied into static buffers
(shared by every size: the largest one's, viewed) and the step is padded up to the next captured
size: padding rows read the null block and write no K/V (slot -1). Steps with prompt tokens, more
requests than the largest size or longer block tables than ``max_model_len`` needs run eagerly.
The logits and the sampler stay outside the graph (they depend on which rows sample).
"""
from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from pagedllm.attention.base import AttentionBackend, AttentionMetadataBuilder, StepInputs
from pagedllm.attention.context import forward_context

logger = logging.getLogger(__name__)


class Graph(Protocol):
    """What the runner needs of a captured graph (a CUDA graph; tests give an eager stand-in)."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run ``fn`` once while recording it; returns its (static) output."""

    def replay(self) -> None:
        """Run what was recorded again, on whatever the static buffers now hold."""


class CudaGraph:
    """A torch.cuda.CUDAGraph captured from a memory pool shared by every size of the ladder."""

    def __init__(self, pool: object) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.cuda.graph(self.graph, pool=self.pool):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


class DecodeGraphs:
    """Static input buffers and one captured graph per batch size of ``sizes``."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, builder: AttentionMetadataBuilder,
                 sizes: tuple[int, ...], block_size: int, max_model_len: int, device: torch.device,
                 make_graph: Callable[[], Graph] | None = None) -> None:
        self.model, self.backend, self.builder = model, backend, builder
        self.sizes = sorted(sizes)
        self.max_model_len, self.block_size = max_model_len, block_size
        self.max_blocks = -(-max_model_len // block_size)
        if make_graph is None:
            pool = torch.cuda.graph_pool_handle()  # the sizes share one pool: captured largest first
            make_graph = lambda: CudaGraph(pool)  # noqa: E731
        self.make_graph = make_graph
        self._allocate_inputs(self.sizes[-1], device)
        self.graphs: dict[int, tuple[Graph, torch.Tensor]] = {}
        self.replays: Counter[int] = Counter()
        """Steps served by the graph of each size."""

    def _allocate_inputs(self, top: int, device: torch.device) -> None:
        """The static input buffers, at the largest size (the smaller ones view them)."""
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(top, self.max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device)  # one token per request

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every size, largest first (the smaller ones reuse its pool memory)."""
        start = time.perf_counter()
        for size in tqdm(self.sizes[::-1], desc="Capturing CUDA graphs", unit=" sizes", leave=False,
                         dynamic_ncols=True):
            step = self._static_step(size)
            metadata = self.builder.build_for_graph(step, self.max_model_len)

            def forward(size: int = size, metadata: object = metadata) -> torch.Tensor:
                with forward_context(self.backend, metadata):
                    return self.model(self.input_ids[:size], self.positions[:size])

            forward()  # warm-up outside the capture: kernels compile, lazy per-step tensors get made
            graph = self.make_graph()
            self.graphs[size] = (graph, graph.capture(forward))
        logger.info("captured %d CUDA graphs (decode batch sizes %s) in %.1f s", len(self.sizes),
                    _ranges(self.sizes), time.perf_counter() - start)

    def size_for(self, step: StepInputs) -> int | None:
        """The captured size that serves ``step`` (the smallest not below its request count), or None
        when it must run eagerly (prompt tokens, too many requests, too long a block table)."""
        n = len(step.req_ids)
        if not self.graphs or n > self.sizes[-1] or step.input_ids.numel() != n \
                or step.block_tables.shape[1] > self.max_blocks:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def run(self, step: StepInputs, size: int) -> torch.Tensor:
        """Fill the static buffers with ``step`` padded to ``size``, replay, and return the hidden states
        of its rows, (num_reqs, hidden): a view the next replay overwrites."""
        n, width = len(step.req_ids), step.block_tables.shape[1]
        self.input_ids[:n].copy_(step.input_ids, non_blocking=True)
        self.positions[:n].copy_(step.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(step.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(step.seq_lens, non_blocking=True)
        self.block_tables[:size].zero_()  # padding rows and the tail of short tables: the null block
        self.block_tables[:n, :width].copy_(step.block_tables, non_blocking=True)
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slot_mapping[n:size].fill_(-1)  # padding rows write no K/V
        self.seq_lens[n:size].fill_(1)  # and attend to one (null-block) key: finite, ignored
        graph, out = self.graphs[size]
        graph.replay()
        self.replays[size] += 1
        return out[:n]

    def _static_step(self, size: int) -> StepInputs:
        """The first ``size`` rows of the static buffers as a decode step."""
        return StepInputs(
            req_ids=[""] * size, input_ids=self.input_ids[:size], positions=self.positions[:size],
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[:size],
            block_size=self.block_size, sample_rows=list(range(size)),
            logits_indices=torch.arange(size))


def _ranges(sizes: list[int]) -> str:
    """The ladder in a log line: every size when few, else the ends and the count."""
    return ", ".join(map(str, sizes)) if len(sizes) <= 8 else f"{sizes[0]}..{sizes[-1]}, {len(sizes)} sizes"
