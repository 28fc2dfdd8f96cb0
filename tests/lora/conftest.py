"""Random PEFT adapters over the tiny Llama (made with peft itself) and the merged reference models."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

#: name -> peft LoraConfig fields of the test adapters
ADAPTERS: dict[str, dict[str, Any]] = {
    "all-r8": dict(r=8, lora_alpha=16, target_modules=ALL_MODULES),
    "qv-r4-rslora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "mlp-r16": dict(r=16, lora_alpha=4, target_modules=["gate_proj", "down_proj"]),
    "attn-r2": dict(r=2, lora_alpha=2, target_modules=["k_proj", "o_proj"]),
}


def make_adapter(base_dir: Path, out: Path, seed: int, **fields: Any) -> tuple[Path, Any]:
    """Save a random adapter (B not zero: init_lora_weights=False, then scaled up so it changes the
    greedy tokens) and return its folder and the merged transformers model (float32)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, lora_dropout=0.0, **fields))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(3.0)
    model.save_pretrained(out)
    return out, model.merge_and_unload().eval()


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


def greedy_reference(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of a transformers model: full forwards, argmax (no generate() rules in the way)."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(max_tokens):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()
