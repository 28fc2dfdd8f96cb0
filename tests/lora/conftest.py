"""Random PEFT adapters over the tiny Llama (made with peft itself) and the merged reference models (by
tests/lora/utils.py's make_adapter)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.lora.utils import make_adapter

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

#: name -> peft LoraConfig fields of the test adapters
ADAPTERS: dict[str, dict[str, Any]] = {
    "all-r8": dict(r=8, lora_alpha=16, target_modules=ALL_MODULES),
    "qv-r4-rslora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "mlp-r16": dict(r=16, lora_alpha=4, target_modules=["gate_proj", "down_proj"]),
    "attn-r2": dict(r=2, lora_alpha=2, target_modules=["k_proj", "o_proj"]),
}


@pytest.fixture(scope="session")
def adapters(tiny_llm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    """adapter name -> (folder, merged transformers model), made once per session."""
    cache: dict[str, tuple[Path, Any]] = {}

    def get(name: str) -> tuple[Path, Any]:
        if name not in cache:
            cache[name] = make_adapter(tiny_llm_dir, tmp_path_factory.mktemp(name), seed=len(cache) + 1,
                                       **ADAPTERS[name])
        return cache[name]

    return get
