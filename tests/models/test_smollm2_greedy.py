"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) in float32: greedy tokens equal transformers'.

Both engines start from the same GGUF weights (transformers dequantizes them itself).
"""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.models.smollm_prompts import MAX_TOKENS, smollm_prompt_ids
from tests.utils import end_levels


@pytest.fixture(scope="module")
def prompt_token_ids(tokenizer: Any) -> list[list[int]]:
    return smollm_prompt_ids(tokenizer)


@pytest.fixture(scope="module")
def reference(default_model: str, prompt_token_ids: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuations (EOS included when it stops there)."""
    from transformers import AutoModelForCausalLM, GgufConfig

    folder, name = os.path.split(default_model)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=default_model, dequantize=True)).eval()
    outs = []
    with torch.no_grad():
        for ids in prompt_token_ids:
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
            outs.append(out[0, len(ids):].tolist())
    return outs


def _generate(llm: LLM, prompt_token_ids: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_token_ids], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.slow
@pytest.mark.parametrize("level", ["portable", *end_levels()], indirect=True)
def test_greedy_matches_transformers(default_model: str, prompt_token_ids, reference, level: str) -> None:
    """The portable torch path and the lowest and highest compiled levels this CPU runs (every kernel is held
    to torch at every level by its own tests)."""
    llm = LLM(default_model, dtype="float32", quantization=None)
    assert _generate(llm, prompt_token_ids) == reference


@pytest.mark.slow
def test_greedy_matches_under_preemption_and_chunking(default_model: str, prompt_token_ids, reference) -> None:
    """A pool of a few dozen blocks and a 64-token budget: same tokens, and both mechanisms ran."""
    llm = LLM(default_model, dtype="float32", num_kv_blocks=40, max_num_batched_tokens=64, quantization=None)
    assert _generate(llm, prompt_token_ids) == reference
    stats = llm.get_stats()
    print(stats)  # shown with -s: how often each mechanism ran
    assert stats.num_preemptions > 0, stats
    assert stats.num_chunked_prefills > 0, stats
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0
    assert llm.llm_engine.engine_core.core.scheduler.kv_cache_manager.check_integrity()
