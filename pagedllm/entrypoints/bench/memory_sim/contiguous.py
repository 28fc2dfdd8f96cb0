"""The Orca baselines: each request reserves one contiguous extent of the pool at admission."""
from __future__ import annotations

import heapq
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pagedllm.entrypoints.bench.memory_sim.series import PoolLimits, StepSeries
from pagedllm.entrypoints.bench.traces import TraceRequest

ORCA_SCHEMES = ("orca-max", "orca-pow2", "orca-oracle")
"""Reserve max_model_len slots / the next power of two >= prompt + output / exactly that."""


class ContiguousAllocator:
    """First-fit allocation of contiguous extents of [0, size); freed extents are merged."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.starts: list[int] = [0]
        self.lengths: list[int] = [size]
        self._largest: int | None = size

    def allocate(self, length: int) -> int | None:
        """Start of the first free extent with room for ``length`` slots, or None."""
        for i, free_len in enumerate(self.lengths):
            if free_len >= length:
                start = self.starts[i]
                if free_len == length:
                    del self.starts[i], self.lengths[i]
                else:
                    self.starts[i] += length
                    self.lengths[i] -= length
                self._largest = None
                return start
        return None

    def release(self, start: int, length: int) -> None:
        """Return [start, start + length), merging it with free neighbours."""
        i = bisect_left(self.starts, start)
        assert i == len(self.starts) or start + length <= self.starts[i], "double free"
        assert i == 0 or self.starts[i - 1] + self.lengths[i - 1] <= start, "double free"
        self.starts.insert(i, start)
        self.lengths.insert(i, length)
        if i + 1 < len(self.starts) and start + length == self.starts[i + 1]:
            self.lengths[i] += self.lengths.pop(i + 1)
            self.starts.pop(i + 1)
        if i > 0 and self.starts[i - 1] + self.lengths[i - 1] == start:
            self.lengths[i - 1] += self.lengths.pop(i)
            self.starts.pop(i)
        self._largest = None

    def largest_free(self) -> int:
        """Length of the largest free extent (cached until the next change)."""
        if self._largest is None:
            self._largest = max(self.lengths, default=0)
        return self._largest

    @property
    def num_free(self) -> int:
        """Free slots in all extents together."""
        return sum(self.lengths)


def reservation_policy(scheme: str, max_model_len: int) -> Callable[[TraceRequest], int]:
    """Slots a request reserves at admission under an Orca scheme."""
    if scheme == "orca-max":
        return lambda item: max_model_len
    if scheme == "orca-pow2":
        return lambda item: min(1 << (item.total_len - 1).bit_length(), max_model_len)
    assert scheme == "orca-oracle", scheme
    return lambda item: item.total_len


@dataclass
class _Running:
    """Running contiguous requests as sums, so that a step costs O(1) besides events."""

    count: int = 0
    sum_prompt: int = 0
    sum_admit_step: int = 0
    sum_final_len: int = 0
    sum_reserved: int = 0

    def add(self, item: TraceRequest, step: int, reserved: int, sign: int = 1) -> None:
        self.count += sign
        self.sum_prompt += sign * item.prompt_len
        self.sum_admit_step += sign * step
        self.sum_final_len += sign * item.total_len
        self.sum_reserved += sign * reserved

    def stored(self, step: int) -> int:
        """K/V held at ``step``: prompt + (step - admit_step) tokens per request."""
        return self.sum_prompt + self.count * step - self.sum_admit_step


class ContiguousSimulator:
    """Iteration-level FCFS serving where each request reserves one contiguous extent."""

    def __init__(self, limits: PoolLimits, reserve: Callable[[TraceRequest], int]) -> None:
        self.limits = limits
        self.reserve = reserve
        self.allocator = ContiguousAllocator(limits.kv_slots)
        self.running = _Running()
        self.waiting: deque[TraceRequest] = deque()
        self.finishes: list[tuple[int, int, int, int, int]] = []
        """Heap of (finish step, index, start, reserved, admit step)."""
        self._items: dict[int, TraceRequest] = {}

    def run(self, trace: list[TraceRequest]) -> StepSeries:
        """Serve ``trace`` to the end; the series of every busy step."""
        pending, series, step = deque(trace), StepSeries(), 0
        while pending or self.waiting or self.running.count:
            if not self.waiting and not self.running.count:
                step = max(step, pending[0].arrival_step)
            while pending and pending[0].arrival_step <= step:
                self.waiting.append(pending.popleft())
            admitted = self._admit(step)
            self._sample(step, series, admitted)
            self._finish(step)
            step += 1
        return series

    def _admit(self, step: int) -> int:
        """Admit FCFS while an extent, the batch limit and the token budget allow."""
        budget = self.limits.max_num_batched_tokens - self.running.count  # one decode token each
        admitted = 0
        while self.waiting and self.running.count < self.limits.max_num_seqs:
            item = self.waiting[0]
            alone = self.running.count == 0  # a prompt larger than the whole budget runs alone
            if item.prompt_len > budget and not alone:
                break
            reserved = self.reserve(item)
            start = self.allocator.allocate(reserved)
            if start is None:
                break
            self.waiting.popleft()
            self.running.add(item, step, reserved)
            self._items[item.index] = item
            heapq.heappush(self.finishes, (step + item.output_len - 1, item.index, start, reserved, step))
            budget -= item.prompt_len
            admitted += 1
        return admitted

    def _sample(self, step: int, series: StepSeries, admitted: int) -> None:
        running = self.running
        assert running.count > 0, f"step {step}: nothing runs"
        stored = running.stored(step)
        free = self.limits.kv_slots - running.sum_reserved
        assert free == self.allocator.num_free, (free, self.allocator.num_free)
        head_blocked = bool(self.waiting) and self.reserve(self.waiting[0]) > self.allocator.largest_free()
        series.add(step, stored, running.sum_final_len - stored, running.sum_reserved - running.sum_final_len,
                   free if head_blocked else 0, running.count)

    def _finish(self, step: int) -> None:
        """Free the requests that sampled their last token this step."""
        while self.finishes and self.finishes[0][0] == step:
            _, index, start, reserved, admit_step = heapq.heappop(self.finishes)
            self.running.add(self._items.pop(index), admit_step, reserved, sign=-1)
            self.allocator.release(start, reserved)


def simulate_contiguous(trace: list[TraceRequest], limits: PoolLimits, scheme: str) -> StepSeries:
    """Replay ``trace`` under the Orca ``scheme`` (one of ``ORCA_SCHEMES``)."""
    return ContiguousSimulator(limits, reservation_policy(scheme, limits.max_model_len)).run(trace)
