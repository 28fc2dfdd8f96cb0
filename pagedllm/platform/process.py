"""How a process of the engine ends once its own shutdown is done."""
from __future__ import annotations

import atexit
import contextlib
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """End this process with ``code`` right after its exit handlers (``atexit``: weakref finalizers, multiprocessing's
    clean-up, logging's flush) and a flush of stdout and stderr, leaving out the interpreter's teardown of every
    module and object: ~1 s for a process that imported torch and transformers and loaded a model (`pagedllm serve`'s
    front and its engine core each paid it: SIGTERM to exit took ~2.5 s). Only once the process's own shutdown is
    complete: its requests ended, its children reaped, its files closed."""
    atexit._run_exitfuncs()  # (what a normal exit runs; the C-level teardown after it is what is left out)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
