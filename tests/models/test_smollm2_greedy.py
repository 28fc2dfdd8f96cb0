"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) in float32: greedy tokens equal transformers'.

Both engines start from the same GGUF weights (transformers dequantizes them itself).
"""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams

MAX_TOKENS = 32
PLAIN = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "東京は日本の首都です。大阪は",
    "Once upon a time",
]
CHATS = [
    [{"role": "user", "content": "What is the tallest mountain in the world?"}],
    [{"role": "user", "content": "Расскажи коротко о Москве."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three prime numbers."},
     {"role": "assistant", "content": "2, 3, 5."},
     {"role": "user", "content": "Three more, please."}],
]
LONG_TEXT = ("PagedAttention stores the key-value cache of every request in fixed-size blocks that need not be "
             "contiguous in memory, much like virtual memory pages in an operating system. ")


@pytest.fixture(scope="module")
def prompt_token_ids(tokenizer: Any) -> list[list[int]]:
    """Plain and chat-templated prompts from 3 to 400 tokens."""
    ids = [tokenizer.encode(p) for p in PLAIN]
    for conv in CHATS:
        text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        ids.append(tokenizer.encode(text, add_special_tokens=False))
    long_ids = tokenizer.encode(LONG_TEXT * 20)
    ids.append(long_ids[:400])
    chat_long = tokenizer.apply_chat_template([{"role": "user", "content": "Summarise: " + LONG_TEXT * 6}],
                                              tokenize=False, add_generation_prompt=True)
    ids.append(tokenizer.encode(chat_long, add_special_tokens=False))
    ids.append(tokenizer.encode("Hi there!"))
    lengths = sorted(len(i) for i in ids)
    assert lengths[0] == 3 and lengths[-1] == 400 and len(ids) >= 8, lengths
    return ids


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
def test_greedy_matches_transformers(default_model: str, prompt_token_ids, reference) -> None:
    llm = LLM(default_model, dtype="float32")
    assert _generate(llm, prompt_token_ids) == reference


@pytest.mark.slow
def test_greedy_matches_under_preemption_and_chunking(default_model: str, prompt_token_ids, reference) -> None:
    """A pool of a few dozen blocks and a 64-token budget: same tokens, and both mechanisms ran."""
    llm = LLM(default_model, dtype="float32", num_kv_blocks=40, max_num_batched_tokens=64)
    assert _generate(llm, prompt_token_ids) == reference
    stats = llm.get_stats()
    print(stats)  # shown with -s: how often each mechanism ran
    assert stats.num_preemptions > 0, stats
    assert stats.num_chunked_prefills > 0, stats
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0
    assert llm.llm_engine.scheduler.kv_cache_manager.check_integrity()
