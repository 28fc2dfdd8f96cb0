"""Model classes by HF architecture name (``architectures[0]``), imported lazily, with what each supports."""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from torch import nn

from pagedllm.errors import ValidationError
from pagedllm.models.config import ArchConfig


@dataclass(frozen=True)
class ModelEntry:
    """One supported architecture: where its class is and what it supports (``pagedllm models`` prints it)."""

    path: str
    """"module:Class", imported only when such a model is loaded."""
    families: str
    """The model families it covers, for people."""
    gguf: bool = False
    """Loads from llama.cpp's GGUF files too."""
    tensor_parallel: bool = True
    sliding_window: bool = False
    """Sliding-window attention (paged: blocks outside the window are freed)."""
    moe: bool = False
    lora: bool = False
    """LoRA adapters (enable_lora)."""


_LLAMA = "pagedllm.models.llama:LlamaForCausalLM"
_MODELS: dict[str, ModelEntry] = {
    "LlamaForCausalLM": ModelEntry(_LLAMA, "Llama 2/3, SmolLM2", gguf=True, lora=True),
    "MistralForCausalLM": ModelEntry(_LLAMA, "Mistral", sliding_window=True, lora=True),
    "Qwen2ForCausalLM": ModelEntry(_LLAMA, "Qwen2, Qwen2.5", gguf=True, lora=True),
    "Qwen3ForCausalLM": ModelEntry(_LLAMA, "Qwen3", gguf=True, lora=True),
    "Phi3ForCausalLM": ModelEntry("pagedllm.models.phi3:Phi3ForCausalLM", "Phi-3 (LongRoPE)", gguf=True,
                                  sliding_window=True, lora=True),
    "MixtralForCausalLM": ModelEntry("pagedllm.models.mixtral:MixtralForCausalLM", "Mixtral", gguf=True, moe=True,
                                     lora=True),
    "Qwen2MoeForCausalLM": ModelEntry("pagedllm.models.qwen2_moe:Qwen2MoeForCausalLM", "Qwen1.5-MoE, Qwen2-MoE",
                                      gguf=True, moe=True, lora=True),
    "Gemma2ForCausalLM": ModelEntry("pagedllm.models.gemma2:Gemma2ForCausalLM", "Gemma 2", gguf=True,
                                    sliding_window=True),
    "Gemma3ForCausalLM": ModelEntry("pagedllm.models.gemma2:Gemma2ForCausalLM", "Gemma 3 (text-only)",
                                    gguf=True, sliding_window=True),
    "GPT2LMHeadModel": ModelEntry("pagedllm.models.gpt2:GPT2LMHeadModel", "GPT-2", gguf=True),
    "OPTForCausalLM": ModelEntry("pagedllm.models.opt:OPTForCausalLM", "OPT (pre-LN, and opt-350m's post-LN)"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def supported_models() -> dict[str, ModelEntry]:
    """Every supported architecture and what it supports."""
    return dict(_MODELS)


def get_model_class(config: ArchConfig) -> type[nn.Module]:
    """The class that implements ``config.architecture``; ValidationError if none does."""
    entry = _MODELS.get(config.architecture)
    if entry is None:
        raise ValidationError(
            f"model architecture {config.architecture!r} is not supported; supported: {supported_architectures()}",
            param="model", value=config.architecture)
    module, cls = entry.path.split(":")
    return getattr(importlib.import_module(module), cls)
