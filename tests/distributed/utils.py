"""The distributed tests' helpers: the executor backends, and what a test leaves behind (processes, shared
memory)."""
from __future__ import annotations

import os

import psutil

BACKENDS = ["mp", "ray"]


def descendants() -> list[psutil.Process]:
    """Every live process this test process started, at any depth."""
    return [p for p in psutil.Process(os.getpid()).children(recursive=True) if p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]


def shm_segments() -> set[str]:
    """Names in /dev/shm (shared-memory segments) now."""
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
