"""The one user-facing error type of pagedllm.

Internal invariants use ``assert``; everything a user can get wrong raises
:class:`ValidationError`, which names the parameter and the value it had.
"""
from __future__ import annotations

from typing import Any

QUOTE_CHARS = 64
"""Most characters of a client-supplied value an error message quotes (a 1 MB id is not echoed back)."""


def quoted(value: Any, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters and "..." when longer."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class ValidationError(ValueError):
    """Bad user input. ``param`` names the offending parameter (HTTP 400 on the server)."""

    def __init__(self, message: str, param: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.value = value

    @classmethod
    def bad_value(cls, param: str, value: Any, expected: str) -> ValidationError:
        """``<param> must be <expected>, got <value>``: the common shape of a range error."""
        return cls(f"{param} must be {expected}, got {quoted(value)}", param=param, value=value)
