"""Run by Python at start-up in the servers the shim starts (remote.py puts this folder on their PYTHONPATH).

A server imports a module of vLLM's tests only when a test names a class in one (``--worker-extension-cls
tests.entrypoints.serve.dev.rpc.test_collective_rpc.TestWorkerExtension``); such a module imports
``tests.utils``, vLLM's test helpers, which are not unpacked: the server finds the shim's stand-in
(``vllm_shim.remote``) there, as the test process does. Nothing is imported until a module asks for it.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from typing import Any


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``tests.utils`` -> the shim's ``vllm_shim.remote``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(fullname, self) if fullname == "tests.utils" else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return importlib.import_module("vllm_shim.remote")

    def exec_module(self, module: Any) -> None:
        """(Already imported.)"""


sys.meta_path.insert(0, _StandIn())
