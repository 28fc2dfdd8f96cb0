"""A GGUF file's tokenizer, converted once and cached.

transformers builds a GGUF file's tokenizer from the vocabulary inside it: ~7 s for SmolLM2's 49k tokens (gguf's
reader makes a numpy view per entry, then the conversion), paid by every process that loads the model (a server's
front and its engine core, each test). The converted tokenizer is saved in the cache
(``$PAGEDLLM_CACHE_DIR/tokenizers/``, keyed by the file's path, size and mtime and the tokenizer libraries'
versions) and read back by every later load in ~0.4 s. A folder appears whole or not at all (written beside and
renamed into place), so a process killed halfway leaves only scratch that a later one sweeps.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedllm.platform.build import cache_root

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1
"""Bumped when what is saved changes (a folder of another format is never read)."""
_SCRATCH = ".tmp-"
_STALE_SCRATCH_S = 3600.0
"""Scratch older than this is a killed process's (a conversion takes seconds)."""


def cache_folder(path: str) -> Path:
    """Where the tokenizer of the GGUF file at ``path`` is cached."""
    import tokenizers
    import transformers

    st = os.stat(path)
    key = [os.path.realpath(path), st.st_size, st.st_mtime_ns, transformers.__version__, tokenizers.__version__,
           CACHE_FORMAT]
    return cache_root() / "tokenizers" / hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]


def load_gguf_tokenizer(path: str) -> Any:
    """The tokenizer of the GGUF file at ``path`` (transformers' conversion), from the cache when it is there.
    The first load converts, saves and reads the saved copy back: every load returns the same tokenizer."""
    from transformers import AutoTokenizer

    folder = cache_folder(path)
    if folder.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError) as e:  # damaged since (a file removed by hand): converted again
            logger.warning("the cached tokenizer in %s does not load (%s): converting the GGUF file's again", folder, e)
            shutil.rmtree(folder, ignore_errors=True)
    directory, name = os.path.split(path)
    converted = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    if not _save(converted, folder):
        return converted  # a cache we cannot write: this process keeps the conversion
    return AutoTokenizer.from_pretrained(str(folder))


def _save(tokenizer: Any, folder: Path) -> bool:
    """Write ``tokenizer`` to ``folder`` atomically; False where the cache cannot be written."""
    scratch = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        _sweep(folder.parent)
        scratch = Path(tempfile.mkdtemp(prefix=folder.name + _SCRATCH, dir=folder.parent))
        tokenizer.save_pretrained(str(scratch))
        try:
            os.rename(scratch, folder)  # atomic: readers see the whole folder or none
        except OSError:
            if not folder.is_dir():  # (else another process saved it first: theirs is the same)
                raise
        return True
    except OSError as e:
        logger.warning("could not cache the GGUF tokenizer in %s (%s): converting it each time", folder.parent, e)
        return False
    finally:
        if scratch is not None and scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)


def _sweep(root: Path) -> None:
    """Remove the scratch folders of conversions killed halfway (older than _STALE_SCRATCH_S)."""
    for entry in root.glob(f"*{_SCRATCH}*"):
        try:
            if time.time() - entry.stat().st_mtime > _STALE_SCRATCH_S:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            continue
