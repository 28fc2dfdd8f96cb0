"""HF folders: config.json and *.safetensors."""
from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from pagedllm.errors import ValidationError
from pagedllm.models.config import ArchConfig


def load_arch_config(folder: str) -> ArchConfig:
    with open(os.path.join(folder, "config.json")) as f:
        return ArchConfig.from_hf(json.load(f))


def iter_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every safetensors file, lazily, one at a time."""
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValidationError(f"no *.safetensors files in {folder!r}", param="model", value=folder)
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
