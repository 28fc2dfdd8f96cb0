"""A GGUF file's tokenizer, converted once and cached.

transformers builds a GGUF file's tokenizer from the vocabulary inside it: ~7 s for SmolLM2's 49k tokens (gguf's
reader makes a numpy view per entry, then the conversion), paid by every process that loads the model (a server's
front and its engine core, each test). The converted tokenizer is saved in the cache
(``$PAGEDLLM_CACHE_DIR/tokenizers/``, keyed by the file's path, size and mtime and the tokenizer libraries'
versions) and read back by every later load in ~0.4 s. A folder appears whole or not at all (written beside and
renamed into place), so a process killed halfway leaves only scratch that a later one sweeps; each conversion also
sweeps the entries of files since removed or changed (no load can reach them: a test's temporary GGUF files).
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
SOURCE_FILE = "pagedllm-source.json"
"""In each entry: the GGUF file it was converted from (path, size, mtime), for the sweep."""
_STALE_SCRATCH_S = 3600.0
"""Scratch older than this is a killed process's (a conversion takes seconds)."""


def cache_folder(path: str) -> Path:
    """Where the tokenizer of the GGUF file at ``path`` is cached."""
    import tokenizers
    import transformers

    source = _source(path)
    key = [source["path"], source["size"], source["mtime_ns"], transformers.__version__, tokenizers.__version__,
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
    if not _save(converted, folder, _source(path)):
        return converted  # a cache we cannot write: this process keeps the conversion
    cached = AutoTokenizer.from_pretrained(str(folder))
    if not same_tokenizer(converted, cached):  # (not seen: a guard against what another transformers might save)
        logger.warning("the GGUF file's tokenizer does not read back as converted from %s: not cached", folder)
        shutil.rmtree(folder, ignore_errors=True)
        return converted
    return cached


PROBE_TEXTS = ("alpha beta window", " leading space", "Hello World", "naïve café 日本語 🎉", "a\n\n\tb  c\r\n",
               "def f(x):\n    return x ** 2", "x" * 40, "")
"""What a cached tokenizer must encode and decode as the conversion does before it is kept."""


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether ``b`` encodes and decodes PROBE_TEXTS (with and without special tokens), and names its special
    tokens, vocabulary size and chat template, as ``a`` does."""
    try:
        for text in PROBE_TEXTS:
            for special in (True, False):
                ids = a.encode(text, add_special_tokens=special)
                if b.encode(text, add_special_tokens=special) != ids or a.decode(ids) != b.decode(ids):
                    return False
        return all(getattr(a, name, None) == getattr(b, name, None) for name in (
            "all_special_ids", "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "chat_template")) \
            and len(a) == len(b)
    except Exception:  # noqa: BLE001  (whatever either raises: not the same)
        return False


def _source(path: str) -> dict[str, Any]:
    st = os.stat(path)
    return {"path": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _save(tokenizer: Any, folder: Path, source: dict[str, Any]) -> bool:
    """Write ``tokenizer`` (converted from ``source``) to ``folder`` atomically; False where the cache cannot be
    written."""
    scratch = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        _sweep(folder.parent)
        scratch = Path(tempfile.mkdtemp(prefix=folder.name + _SCRATCH, dir=folder.parent))
        tokenizer.save_pretrained(str(scratch))
        _as_saved(scratch)
        (scratch / SOURCE_FILE).write_text(json.dumps(source))
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


def _as_saved(folder: Path) -> None:
    """Read the saved tokenizer back as its tokenizer.json says: transformers rebuilds a model's own tokenizer class
    (Gemma's, Qwen2's) from that class's defaults, not the converted pipeline (a GGUF Gemma 3 tokenizer read back
    as GemmaTokenizer split "alpha beta" on <unk>); the generic backend takes the file as it is."""
    config_path = folder / "tokenizer_config.json"
    if not (folder / "tokenizer.json").exists() or not config_path.exists():
        return
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # (transformers 5 names it TokenizersBackend too)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))


def _sweep(root: Path) -> None:
    """Remove the scratch folders of conversions killed halfway (older than _STALE_SCRATCH_S) and the entries no
    load can reach any more."""
    for entry in root.iterdir():
        try:
            if _SCRATCH in entry.name:
                if time.time() - entry.stat().st_mtime > _STALE_SCRATCH_S:
                    shutil.rmtree(entry, ignore_errors=True)
            elif _unreachable(entry):
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            continue


def _unreachable(entry: Path) -> bool:
    """Whether ``entry``'s GGUF file is gone or has changed since it was converted (its key can no longer come up)."""
    try:
        source = json.loads((entry / SOURCE_FILE).read_text())
        st = os.stat(source["path"])
    except FileNotFoundError as e:
        return e.filename != str(entry / SOURCE_FILE)  # the GGUF file is gone (an entry without the record: kept)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return (st.st_size, st.st_mtime_ns) != (source.get("size"), source.get("mtime_ns"))
