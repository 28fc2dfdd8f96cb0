"""The one scoped global of the engine: this step's attention metadata and backend.

Models never see requests or blocks; their Attention layers read the step's metadata here.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pagedllm.attention.base import AttentionBackend


@dataclass(kw_only=True)
class ForwardContext:
    """What attention layers need during one forward pass."""

    backend: AttentionBackend
    metadata: Any


_current: ForwardContext | None = None


@contextmanager
def forward_context(backend: AttentionBackend, metadata: Any) -> Iterator[ForwardContext]:
    """Make ``metadata`` visible to attention layers for the duration of one forward pass."""
    global _current
    assert _current is None, "forward contexts do not nest"
    _current = ForwardContext(backend=backend, metadata=metadata)
    try:
        yield _current
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    """The active context; asserts that a forward pass is in progress."""
    assert _current is not None, "attention called outside `with forward_context(...)`"
    return _current
