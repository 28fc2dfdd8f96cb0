"""Beam search with the default model (float32) against transformers' beam search on the same weights.

Definitions are the same (see pagedllm/engine/beam_search.py): top-2k candidates, the best k
that do not end continue, finished hypotheses scored cum_logprob / generated_length **
length_penalty, transformers' early-stopping heuristic (early_stopping=False). Differences:
transformers returns the best sequence (num_return_sequences=1); we return beam_width
sequences, best first, whose tokens and text include the prompt (as vLLM's beam_search does).
"""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from pagedllm import LLM
from pagedllm.sampling_params import BeamSearchParams
from tests.utils import assert_pool_clean

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time, there was a",
           "The three laws of robotics are", "Water boils at"]
CHATS = ["Reply with one word: is the sky blue?", "Name a fruit."]
BEAM_WIDTH, MAX_TOKENS = 4, 24


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Any) -> list[list[int]]:
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                           add_generation_prompt=True) for c in CHATS]
    return [tokenizer.encode(p) for p in PROMPTS] + [tokenizer.encode(c, add_special_tokens=False) for c in chats]


@pytest.fixture(scope="module")
def hf_model(default_model: str) -> Any:
    from transformers import AutoModelForCausalLM, GgufConfig

    folder, name = os.path.split(default_model)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                quantization_config=GgufConfig(gguf_file=default_model,
                                                                               dequantize=True)).eval()


@pytest.fixture(scope="module")
def llm(default_model: str) -> LLM:
    return LLM(default_model, dtype="float32", num_kv_blocks=600, quantization=None)


@pytest.mark.slow
@pytest.mark.parametrize("length_penalty", [0.5])  # vLLM's and transformers' default 1.0 is the simpler case
def test_beam_search_matches_transformers(llm: LLM, hf_model: Any, prompt_ids: list[list[int]], tokenizer: Any,
                                          length_penalty: float) -> None:
    params = BeamSearchParams(beam_width=BEAM_WIDTH, max_tokens=MAX_TOKENS, length_penalty=length_penalty)
    ours = llm.beam_search([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    hf = hf_model
    reasons = set()
    for ids, out in zip(prompt_ids, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), num_beams=BEAM_WIDTH, do_sample=False, max_new_tokens=MAX_TOKENS,
                              length_penalty=length_penalty, early_stopping=False)[0, len(ids):].tolist()
        best = out.sequences[0]
        assert best.tokens == ids + ref, (tokenizer.decode(best.tokens[len(ids):]), tokenizer.decode(ref))
        assert len(out.sequences) == BEAM_WIDTH
        assert [s.score for s in out.sequences] == sorted((s.score for s in out.sequences), reverse=True)
        reasons.add(best.finish_reason)
    assert reasons == {"stop", "length"}, reasons  # both ways of ending were compared
    assert_pool_clean(llm)


def test_beams_share_blocks(tiny_llm_dir) -> None:
    """Peak blocks of a beam search stay well below beam_width independent sequences."""
    width, prompt_len, max_tokens = 4, 60, 24
    llm = LLM(str(tiny_llm_dir), dtype="float32", num_kv_blocks=200, block_size=16, enable_prefix_caching=False)
    llm.beam_search({"prompt_token_ids": list(range(100, 100 + prompt_len))},
                    BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    stats = llm.get_stats()
    peak_blocks = round(stats.max_kv_cache_usage * (stats.num_kv_blocks - 1))
    independent = width * -(-(prompt_len + max_tokens) // 16)
    assert stats.num_forks >= width * (max_tokens - 2)
    assert peak_blocks < independent / 2, (peak_blocks, independent)
    assert_pool_clean(llm)
