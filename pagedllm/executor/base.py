"""The executor interface the engine talks to (executor/factory.py picks the implementation).

Three implementations run the same ``Worker`` (worker/worker.py): ``UniProcExecutor`` (one
worker in the engine's own process, tp=1), ``MultiprocExecutor`` (one worker process per
tensor-parallel rank on this machine) and ``RayDistributedExecutor`` (one Ray actor per rank,
on any number of machines).
"""
from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from typing import Any, NoReturn

from pagedllm import envs
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.outputs import ModelRunnerOutput

logger = logging.getLogger(__name__)

EXECUTE_TIMEOUT_ENV = envs.EXECUTE_MODEL_TIMEOUT_SECONDS.name
"""Seconds a step may take on a worker before the engine declares it hung (default 300)."""


def execute_timeout() -> float:
    """The step timeout (EXECUTE_TIMEOUT_ENV), read when an executor starts."""
    return envs.EXECUTE_MODEL_TIMEOUT_SECONDS.read()


def process_stopped(pid: int) -> bool:
    """Whether process ``pid`` of this machine is stopped (SIGSTOP, a debugger): it cannot answer."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


class WorkerError(RuntimeError):
    """A worker died, failed or stopped answering; the engine cannot go on. Names the rank."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class Executor(ABC):
    """Runs every worker on each step's plain-data SchedulerOutput.

    Every worker (one per tensor-parallel rank) gets the same SchedulerOutput, and the engine
    reads rank 0's sampled tokens (every rank samples the same ones).
    """

    def __init__(self) -> None:
        self.failure: WorkerError | None = None
        """Set once a worker failed; every later call raises it."""
        self._failure_callbacks: list[Callable[[WorkerError], None]] = []
        self._failure_lock = threading.Lock()
        self.batches_in_flight = 1
        """Batches the engine core may keep in flight (pipeline stages: set by the executor once its ranks are
        placed, from ParallelConfig.batches_in_flight or where the stages run)."""
        self._answers: deque[Any] = deque()
        """Steps submitted and not collected: their answers (here), or what waits for them (Ray's refs)."""

    def register_failure_callback(self, callback: Callable[[WorkerError], None]) -> None:
        """Call ``callback`` (from any thread) as soon as a worker fails, even between steps."""
        self._failure_callbacks.append(callback)

    def _fail(self, error: WorkerError) -> NoReturn:
        """Remember the first failure, stop every worker, tell the engine, raise (from any thread)."""
        with self._failure_lock:
            first, self.failure = self.failure is None, self.failure or error
        if first:
            logger.error("%s; stopping the engine's workers", error)
            self._kill_workers()
            for callback in self._failure_callbacks:
                callback(error)
        raise self.failure

    def _kill_workers(self) -> None:  # noqa: B027 (a no-op unless overridden: an in-process worker dies with us)
        """Stop every worker at once, without waiting for an answer (after a failure)."""

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """Call ``Worker.<method>(*args)`` on every rank; the results in rank order."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; returns rank 0's sampled tokens."""

    def submit_model(self, scheduler_output: SchedulerOutput) -> None:
        """Start a step without waiting for it (pipeline stages: several batches in flight); ``collect_model``
        returns the answers in the order the steps were submitted. Here: run it now, keep its answer."""
        self._answers.append(self.execute_model(scheduler_output))

    def collect_model(self) -> ModelRunnerOutput:
        """The answer of the oldest step submitted and not yet collected (waiting for it)."""
        return self._answers.popleft()

    def determine_num_kv_blocks(self) -> int:
        """KV blocks that fit on every worker (the smallest rank's answer)."""
        return min(self.collective_rpc("determine_num_kv_blocks"))

    def determine_num_host_blocks(self) -> int:
        """Host (swap) blocks every worker can hold; 0 unless preemption_mode is "swap"."""
        return min(self.collective_rpc("determine_num_host_blocks"))

    def initialize_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        """Allocate ``num_blocks`` device and ``num_host_blocks`` host KV blocks on every worker
        (the same block ids on every rank; each holds its own heads)."""
        self.collective_rpc("initialize_cache", (num_blocks, num_host_blocks))

    def compile_or_warm_up_model(self) -> None:
        """Get every worker ready for its first step once its KV pools exist (a GPU's CUDA graphs captured)."""
        self.collective_rpc("compile_or_warm_up_model")

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker and free what they hold (idempotent)."""
