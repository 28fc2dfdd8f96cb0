"""Shared fixtures: the default model, its tokenizer, and tiny random models saved with transformers."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import pagedllm  # noqa: F401  (first: a PAGEDLLM_ISA level caps torch's own kernels before torch loads)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever fetched from a hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: Tiny architectures the model tests cover; each is saved by transformers and loaded by us.
TINY_VARIANTS: dict[str, dict[str, Any]] = {
    "llama-gqa-untied": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "llama-mha-tied": dict(arch="llama", num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "llama3-rope-scaling": dict(arch="llama", num_attention_heads=4, num_key_value_heads=1, rope_theta=500000.0,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "llama-linear-rope": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2,
                              rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama-attention-bias": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2, attention_bias=True),
    "qwen2-qkv-bias": dict(arch="qwen2", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "mistral": dict(arch="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=None),
    "mistral-sliding-window": dict(arch="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=10),
    "qwen3-qk-norm": dict(arch="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          tie_word_embeddings=False),
    "gpt2": dict(arch="gpt2", num_attention_heads=4, n_inner=128),
    "opt-pre-ln": dict(arch="opt", num_attention_heads=4, ffn_dim=128, do_layer_norm_before=True),
    "opt-350m-style": dict(arch="opt", num_attention_heads=4, ffn_dim=128, do_layer_norm_before=False,
                           word_embed_proj_dim=32),
    "phi3-longrope": dict(arch="phi3", num_attention_heads=4, num_key_value_heads=2,
                          original_max_position_embeddings=64, sliding_window=None, pad_token_id=0,
                          rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
                                        "long_factor": [2.0 + i / 4 for i in range(8)]}),
    "gemma2": dict(arch="gemma2", num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
                   query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                   num_hidden_layers=3),
    "gemma3": dict(arch="gemma3", num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
                   query_pre_attn_scalar=24, num_hidden_layers=3,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "mixtral": dict(arch="mixtral", num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=48),
    "qwen2-moe": dict(arch="qwen2_moe", num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1], num_hidden_layers=3),
}


def kernel_levels() -> list[str]:
    """Every level with compiled kernels this process runs: the CPU's own (or PAGEDLLM_ISA's, which
    makes the whole suite behave as on such a CPU) and each one below it, forced in turn."""
    from pagedllm.platform.cpu import LEVELS, isa_level

    top = isa_level()
    return [level for level in LEVELS[1:LEVELS.index(top) + 1] if level != "amx"]  # amx runs avx512_bf16's


def _at_level(level: str) -> Any:
    """Context: ``level`` made the active one (skips the test where its kernels did not build)."""
    from pagedllm.layers import cpu_ops

    context = cpu_ops.use_level(level)
    context.__enter__()
    active = cpu_ops.active()
    if level != "portable" and (active is None or active.level != level):
        context.__exit__(None, None, None)
        pytest.skip(f"the {level} kernels did not build here")
    return context, active


NO_KERNELS = "no compiled kernel level here: the CPU (or PAGEDLLM_ISA) allows only the portable one"


def end_levels() -> list[str]:
    """The lowest and the highest compiled level this process runs: for whole-model tests, whose every kernel is
    tested at each level on its own (the levels between run the same code paths at another width)."""
    levels = kernel_levels()
    return sorted({levels[0], levels[-1]}, key=levels.index) if levels else []


@pytest.fixture(params=kernel_levels() or [pytest.param(None, marks=pytest.mark.skip(reason=NO_KERNELS))])
def kernels(request: pytest.FixtureRequest) -> Any:
    """The CpuKernels of one level (each level this CPU runs), made the active level for the test."""
    context, active = _at_level(request.param)
    yield active
    context.__exit__(None, None, None)


@pytest.fixture(params=["portable", *kernel_levels()])
def level(request: pytest.FixtureRequest) -> Any:
    """Each level this CPU runs, the portable one (torch's own ops) included, made the active level."""
    context, _ = _at_level(request.param)
    yield request.param
    context.__exit__(None, None, None)


@pytest.fixture(scope="session")
def default_model() -> str:
    from pagedllm.models.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(default_model: str) -> Any:
    from pagedllm.models.loader import load_tokenizer

    return load_tokenizer(default_model)


def save_tiny_model(path: Path, variant: str, vocab_size: int = 512, tokenizer: Any = None, seed: int = 0,
                    **overrides: Any) -> Path:
    """Save a tiny random model of ``variant`` (weights scaled up so logits are not all ~0); ``overrides``
    change config fields of the variant."""
    import torch
    from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config,
                              GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              MixtralConfig, MixtralForCausalLM, OPTConfig, OPTForCausalLM, Phi3Config,
                              Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    spec = {**TINY_VARIANTS[variant], **overrides}
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                             "mistral": (MistralConfig, MistralForCausalLM),
                             "qwen3": (Qwen3Config, Qwen3ForCausalLM), "gpt2": (GPT2Config, GPT2LMHeadModel),
                             "opt": (OPTConfig, OPTForCausalLM), "mixtral": (MixtralConfig, MixtralForCausalLM),
                             "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
                             "phi3": (Phi3Config, Phi3ForCausalLM), "gemma2": (Gemma2Config, Gemma2ForCausalLM),
                             "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM)}[spec.pop("arch")]
    fields = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    config = config_cls(**{**fields, **spec})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # biases and norms start at 0 / 1: randomise them so they are tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """variant -> folder with a tiny random model (vocab 512) and a word-level tokenizer of its vocabulary."""
    from tests.tiny_tokenizer import save_word_tokenizer

    cache: dict[str, Path] = {}

    def make(variant: str) -> Path:
        if variant not in cache:
            cache[variant] = save_tiny_model(tmp_path_factory.mktemp(variant), variant)
            save_word_tokenizer(cache[variant], 512)
        return cache[variant]

    return make


@pytest.fixture(scope="session")
def tiny_llm_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    """A tiny random Llama with the default model's tokenizer: fast engine tests with real text."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llm"), "llama-gqa-untied",
                           vocab_size=len(tokenizer), tokenizer=tokenizer)
