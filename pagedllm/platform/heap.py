"""Giving the C heap's free pages back to the OS while a model loads.

glibc's malloc serves allocations below its mmap threshold from its heap, and that threshold rises to the size of
each large block freed (up to 32 MiB): after the first few weights are freed, a loader's transient tensors (a
tensor decoded from a GGUF file, a slice being packed) come from the heap, and their pages stay there, resident,
after they are freed. Loading a 100 MB model from a GGUF file ended 32 MiB above its weights from that alone.
``trim`` hands the free pages back (``malloc_trim``: microseconds when there is little to give back), so the
peak RSS while loading is what is live, not every transient the heap once held.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's; absent elsewhere (musl, macOS)
    except (OSError, AttributeError):
        return None


def trim() -> None:
    """Return the heap's free pages to the OS where the C library can (glibc); otherwise nothing."""
    malloc_trim = _malloc_trim()
    if malloc_trim is not None:
        malloc_trim(0)
