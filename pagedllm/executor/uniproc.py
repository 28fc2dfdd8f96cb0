"""One worker in the engine's own process (tp=1)."""
from __future__ import annotations

from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.executor.base import Executor
from pagedllm.models.config import ArchConfig
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.worker.extension import make_worker
from pagedllm.worker.user_calls import destroy_extension


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, arch: ArchConfig, eos_token_ids: tuple[int, ...]) -> None:
        super().__init__()
        self.worker = make_worker(config, arch, eos_token_ids)
        self._closed = False

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        if not self._closed:  # (idempotent)
            self._closed = True
            destroy_extension(self.worker)  # (tp=1: no process group to leave)
