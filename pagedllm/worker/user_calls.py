"""The calls a user makes on workers (vLLM's collective_rpc) and a worker extension's hooks.

``user_call`` runs a user's call on one worker and answers its failure as data: a user's method that raises fails
that call alone, never the engine (an executor takes a worker's exception for a dead worker). Kept apart from
worker/extension.py, which builds Worker subclasses: the Worker calls these, so they must not import it.
"""
from __future__ import annotations

import functools
import logging
import pickle
from collections.abc import Callable
from typing import Any

from pagedllm.errors import ValidationError

logger = logging.getLogger(__name__)

INIT_HOOK = "init_worker_extension"
"""An extension's method called once its worker is loaded (vLLM's hook of that name)."""
DESTROY_HOOK = "destroy_worker_extension"
"""An extension's method called (best effort) before its worker shuts down."""



def destroy_extension(worker: Any) -> None:
    """The extension's destroy hook, best effort (shutdown goes on whatever it raises)."""
    hook = getattr(worker, DESTROY_HOOK, None)
    if callable(hook):
        try:
            hook()
        except Exception:  # the worker's own shutdown must still run
            logger.exception("the worker extension's %s failed", DESTROY_HOOK)


def resolve_method(worker: Any, method: str | bytes) -> Callable[..., Any]:
    """The bound method ``method`` names (a public attribute), or a pickled function called with the worker
    first (LLM.collective_rpc given a function); ValidationError naming method otherwise."""
    if isinstance(method, bytes):
        return functools.partial(pickle.loads(method), worker)
    if not isinstance(method, str) or not method or method.startswith("_"):
        raise ValidationError.bad_value("method", method, "the name of a public worker method")
    func = getattr(worker, method, None)
    if not callable(func):
        raise ValidationError(f"the worker has no method {method!r} (a --worker-extension-cls class adds methods)",
                              param="method", value=method)
    return func


def user_call(worker: Any, method: str | bytes, args: tuple, kwargs: dict[str, Any]) -> tuple[bool, Any]:
    """(True, result) or (False, (error type name, message, param)) of ``method(*args, **kwargs)`` on ``worker``."""
    try:
        return True, resolve_method(worker, method)(*args, **kwargs)
    except Exception as e:  # the caller's error, answered as data (see the module docstring)
        logger.warning("collective_rpc %r failed: %r", method if isinstance(method, str) else "<function>", e)
        return False, (type(e).__name__, str(e) or type(e).__name__, getattr(e, "param", None))
