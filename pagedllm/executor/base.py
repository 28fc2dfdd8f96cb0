"""The executor interface the engine talks to: the same calls at tp=1, tp=N and across Ray."""
from __future__ import annotations

from abc import ABC, abstractmethod

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.outputs import ModelRunnerOutput


class Executor(ABC):
    """Runs every worker on each step's plain-data SchedulerOutput."""

    @abstractmethod
    def determine_num_kv_blocks(self) -> int:
        """KV blocks that fit on every worker."""

    @abstractmethod
    def determine_num_host_blocks(self) -> int:
        """Host (swap) blocks every worker can hold; 0 unless preemption_mode is "swap"."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        """Allocate ``num_blocks`` device and ``num_host_blocks`` host KV blocks on every worker."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; returns the (rank 0) sampled tokens."""
