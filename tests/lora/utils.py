"""The LoRA tests' helpers: random PEFT adapters made with peft itself, and transformers' greedy tokens."""
from __future__ import annotations

from pathlib import Path
from typing import Any


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


def greedy_reference(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of a transformers model: full forwards, argmax (no generate() rules in the way)."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(max_tokens):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()
