"""Worker extensions (vLLM's --worker-extension-cls): the Worker with a user's class mixed in.

``worker_class(path)`` is the Worker with the class ``path`` names mixed in after it (the Worker's own attributes
win, and an extension that would shadow one is refused, as vLLM does); every executor builds its workers with
``make_worker``, which runs the extension's init hook. The calls a user makes on workers are worker/user_calls.py.
"""
from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING

from pagedllm.errors import ValidationError
from pagedllm.worker.user_calls import INIT_HOOK

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.models.config import ArchConfig
    from pagedllm.worker.worker import RankInfo, Worker


@functools.lru_cache(maxsize=8)
def worker_class(path: str = "") -> type:
    """The Worker, or with ``path`` ("package.module.Class") a subclass of it and that class; ValidationError
    naming worker_extension_cls if the class cannot be imported or shadows a Worker attribute."""
    from pagedllm.worker.worker import Worker
    if not path:
        return Worker
    module_name, _, class_name = path.rpartition(".")
    try:
        extension = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValidationError(f"worker_extension_cls {path!r} cannot be imported: {e}", param="worker_extension_cls",
                              value=path) from None
    if not isinstance(extension, type):
        raise ValidationError.bad_value("worker_extension_cls", path, "a class")
    clashes = sorted(name for name in dir(extension) if not name.startswith("__") and hasattr(Worker, name))
    if clashes:
        raise ValidationError(f"worker_extension_cls {path!r} would shadow the worker's own {clashes}",
                              param="worker_extension_cls", value=path)
    return type(f"Worker[{extension.__name__}]", (Worker, extension), {"__module__": Worker.__module__})


def make_worker(config: EngineConfig, arch: ArchConfig, eos_token_ids: tuple[int, ...],
                rank_info: RankInfo | None = None) -> Worker:
    """A worker of config's class (with its extension) through its first phases: its device claimed and its model
    loaded; the extension's init hook run after them."""
    worker = worker_class(config.parallel.worker_extension_cls)(config, arch, eos_token_ids, rank_info)
    worker.init_device()
    worker.load_model()
    hook = getattr(worker, INIT_HOOK, None)
    if callable(hook):
        hook()
    return worker
