"""HF folders: config.json and *.safetensors."""
from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from pagedllm.errors import ValidationError
from pagedllm.models.config import ArchConfig, as_id_tuple


def read_config(folder: str) -> dict:
    """The folder's config.json as a dict."""
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def load_arch_config(folder: str) -> ArchConfig:
    return ArchConfig.from_hf(read_config(folder))


def generation_eos_token_ids(folder: str) -> tuple[int, ...]:
    """The eos_token_id entry of generation_config.json (an id or a list), if the folder has one."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.exists(path):
        return ()
    with open(path) as f:
        return as_id_tuple(json.load(f).get("eos_token_id"))


def iter_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every safetensors file, lazily, one at a time."""
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValidationError(f"no *.safetensors files in {folder!r}", param="model", value=folder)
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
