"""Model classes by HF architecture name (``architectures[0]``), imported lazily."""
from __future__ import annotations

import importlib

from torch import nn

from pagedllm.errors import ValidationError
from pagedllm.models.config import ArchConfig

_MODELS = {
    "LlamaForCausalLM": "pagedllm.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "pagedllm.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "pagedllm.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "pagedllm.models.llama:LlamaForCausalLM",
    "GPT2LMHeadModel": "pagedllm.models.gpt2:GPT2LMHeadModel",
    "OPTForCausalLM": "pagedllm.models.opt:OPTForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(config: ArchConfig) -> type[nn.Module]:
    """The class that implements ``config.architecture``; ValidationError if none does."""
    target = _MODELS.get(config.architecture)
    if target is None:
        raise ValidationError(
            f"model architecture {config.architecture!r} is not supported; supported: {supported_architectures()}",
            param="model", value=config.architecture)
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)
