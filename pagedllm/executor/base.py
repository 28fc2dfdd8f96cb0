"""The executor interface the engine talks to.

One implementation exists: ``UniProcExecutor`` (executor/uniproc.py), one worker in the engine's
own process (tp=1). Executors that run tensor-parallel workers in other processes come with the
distributed-execution issue; they implement these same calls, so the engine does not change.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.outputs import ModelRunnerOutput


class Executor(ABC):
    """Runs every worker on each step's plain-data SchedulerOutput.

    Every worker (one per tensor-parallel rank; today only rank 0) gets the same
    SchedulerOutput, and the engine reads rank 0's sampled tokens.
    """

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
