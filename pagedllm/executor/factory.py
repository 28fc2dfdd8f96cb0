"""Which executor runs an engine's workers."""
from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.executor.base import Executor


def get_executor_class(config: EngineConfig) -> type[Executor]:
    """The executor of ``config.parallel.distributed_executor_backend`` ("uni", "mp" or "ray"); each
    is imported only when chosen (Ray need not be installed for the others)."""
    backend = config.parallel.distributed_executor_backend
    if backend == "uni":
        from pagedllm.executor.uniproc import UniProcExecutor
        return UniProcExecutor
    if backend == "mp":
        from pagedllm.executor.multiproc import MultiprocExecutor
        return MultiprocExecutor
    from pagedllm.executor.ray_executor import RayDistributedExecutor
    return RayDistributedExecutor
