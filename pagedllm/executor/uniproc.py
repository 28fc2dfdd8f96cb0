"""One worker in the engine's own process."""
from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.executor.base import Executor
from pagedllm.models.config import ArchConfig
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, arch: ArchConfig, eos_token_ids: tuple[int, ...]) -> None:
        self.worker = Worker(config, arch, eos_token_ids)

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def determine_num_host_blocks(self) -> int:
        return self.worker.determine_num_host_blocks()

    def initialize_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks, num_host_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)
