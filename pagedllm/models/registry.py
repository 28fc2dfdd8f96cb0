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
    pipeline_parallel: bool = False
    """Runs split into pipeline stages (pipeline_parallel_size > 1)."""
    sliding_window: bool = False
    """Sliding-window attention (paged: blocks outside the window are freed)."""
    moe: bool = False
    lora: bool = False
    """LoRA adapters (enable_lora)."""


_LLAMA = "pagedllm.models.llama:LlamaForCausalLM"
_LLAMA_CLS = "pagedllm.models.llama:LlamaForSequenceClassification"
_BERT = "pagedllm.models.bert"
_MODELS: dict[str, ModelEntry] = {
    "LlamaForCausalLM": ModelEntry(_LLAMA, "Llama 2/3, SmolLM2", gguf=True, lora=True, pipeline_parallel=True),
    "MistralForCausalLM": ModelEntry(_LLAMA, "Mistral", sliding_window=True, lora=True, pipeline_parallel=True),
    "Qwen2ForCausalLM": ModelEntry(_LLAMA, "Qwen2, Qwen2.5", gguf=True, lora=True, pipeline_parallel=True),
    "Qwen3ForCausalLM": ModelEntry(_LLAMA, "Qwen3", gguf=True, lora=True, pipeline_parallel=True),
    "Phi3ForCausalLM": ModelEntry("pagedllm.models.phi3:Phi3ForCausalLM", "Phi-3 (LongRoPE)", gguf=True,
                                  sliding_window=True, lora=True, pipeline_parallel=True),
    "MixtralForCausalLM": ModelEntry("pagedllm.models.mixtral:MixtralForCausalLM", "Mixtral", gguf=True, moe=True,
                                     lora=True, pipeline_parallel=True),
    "Qwen2MoeForCausalLM": ModelEntry("pagedllm.models.qwen2_moe:Qwen2MoeForCausalLM", "Qwen1.5-MoE, Qwen2-MoE",
                                      gguf=True, moe=True, lora=True, pipeline_parallel=True),
    "Gemma2ForCausalLM": ModelEntry("pagedllm.models.gemma2:Gemma2ForCausalLM", "Gemma 2", gguf=True,
                                    sliding_window=True),
    "Gemma3ForCausalLM": ModelEntry("pagedllm.models.gemma2:Gemma2ForCausalLM", "Gemma 3 (text-only)",
                                    gguf=True, sliding_window=True),
    "GPT2LMHeadModel": ModelEntry("pagedllm.models.gpt2:GPT2LMHeadModel", "GPT-2", gguf=True),
    "OPTForCausalLM": ModelEntry("pagedllm.models.opt:OPTForCausalLM", "OPT (pre-LN, and opt-350m's post-LN)"),
    # encoder-only (pooling: embeddings, scores, classes); a masked-LM checkpoint serves its encoder's states
    # decoder classifiers and reward models: the decoder with a score head read at the last token (pooling runner)
    "LlamaForSequenceClassification": ModelEntry(_LLAMA_CLS, "Llama classifiers / reward models"),
    "MistralForSequenceClassification": ModelEntry(_LLAMA_CLS, "Mistral classifiers"),
    "Qwen2ForSequenceClassification": ModelEntry(_LLAMA_CLS, "Qwen2 classifiers / reward models"),
    "Qwen3ForSequenceClassification": ModelEntry(_LLAMA_CLS, "Qwen3 classifiers / rerankers"),
    "BertModel": ModelEntry(f"{_BERT}:BertModel", "BERT embedders (all-MiniLM, BGE, E5)", tensor_parallel=False),
    "BertForMaskedLM": ModelEntry(f"{_BERT}:BertModel", "BERT (encoder only)", tensor_parallel=False),
    "BertForSequenceClassification": ModelEntry(f"{_BERT}:BertForSequenceClassification",
                                                "BERT cross-encoders, classifiers", tensor_parallel=False),
    "RobertaModel": ModelEntry(f"{_BERT}:RobertaModel", "RoBERTa embedders", tensor_parallel=False),
    "RobertaForMaskedLM": ModelEntry(f"{_BERT}:RobertaModel", "RoBERTa (encoder only)", tensor_parallel=False),
    "RobertaForSequenceClassification": ModelEntry(f"{_BERT}:RobertaForSequenceClassification",
                                                   "RoBERTa cross-encoders, classifiers", tensor_parallel=False),
    "XLMRobertaModel": ModelEntry(f"{_BERT}:RobertaModel", "XLM-R embedders (multilingual-e5, bge-m3)",
                                  tensor_parallel=False),
    "XLMRobertaForMaskedLM": ModelEntry(f"{_BERT}:RobertaModel", "XLM-R (encoder only)", tensor_parallel=False),
    "XLMRobertaForSequenceClassification": ModelEntry(f"{_BERT}:RobertaForSequenceClassification",
                                                      "XLM-R cross-encoders (bge-reranker)", tensor_parallel=False),
    "ModernBertModel": ModelEntry("pagedllm.models.modernbert:ModernBertModel",
                                  "ModernBERT embedders (gte-modernbert, modernbert-embed)", tensor_parallel=False),
    "ModernBertForSequenceClassification": ModelEntry("pagedllm.models.modernbert:ModernBertForSequenceClassification",
                                                      "ModernBERT classifiers, cross-encoders", tensor_parallel=False),
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
