"""The distributed tests' helpers: the executor backends, and what a test leaves behind (processes, shared
memory)."""
from __future__ import annotations

import os
from typing import Any

import psutil

BACKENDS = ["mp", "ray"]


def descendants() -> list[psutil.Process]:
    """Every live process this test process started, at any depth."""
    return [p for p in psutil.Process(os.getpid()).children(recursive=True) if p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]


def ray_auth_disabled(monkeypatch: Any) -> None:
    """RAY_AUTH_MODE=disabled for this test's Ray connection, and Ray's cached auth state of an earlier one in this
    process dropped: a local cluster started in-process (the executors' tests) turns token auth on and caches it
    (and its token in ~/.ray), and a later connection to a cluster without auth then gets no actor started."""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    try:
        from ray._private.authentication_test_utils import reset_auth_token_state  # (Ray's own tests' helper)
    except ImportError:
        return
    reset_auth_token_state()


def shm_segments() -> set[str]:
    """Names in /dev/shm (shared-memory segments) now."""
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
