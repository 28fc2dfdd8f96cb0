"""The int8 KV cache (kv_cache_dtype="int8") end to end: about twice the blocks of a bf16 cache in the same
memory, the default model's greedy tokens and perplexity against bf16 K/V, and the option checked."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pagedllm import LLM
from pagedllm.errors import ValidationError
from tests.models.smollm_prompts import common_prefixes, greedy_and_perplexity


@pytest.mark.slow
def test_default_model_int8_kv_against_bf16_kv(default_model: str, tokenizer: Any) -> None:
    """SmolLM2-135M-Instruct in bfloat16 with bf16 K/V, then with int8 K/V, in the same 256 MiB: the blocks
    (measured 1412 vs 728: 2 * 64 / (64 + 2) = 1.94x, a float16 scale per slot and head), greedy tokens on 8
    prompts (agreement printed, measured 0.78 on a Zen 4, 0.50 and 0.49 on an AMX Xeon; every first token the same
    but one at most) and
    perplexity on the shipped prose within 1% (measured 21.240 vs 21.117)."""
    runs, values, blocks = greedy_and_perplexity(default_model, tokenizer, [
        {"dtype": "bfloat16", "kv_cache_dtype": kv} for kv in ("auto", "int8")])
    prefix = common_prefixes(*runs)
    agreement = sum(prefix) / (32 * len(prefix))
    print(f"int8 vs bf16 KV: blocks {blocks[1]} vs {blocks[0]} ({blocks[1] / blocks[0]:.3f}x); greedy agreement "
          f"{agreement:.2f} (common prefixes {prefix}); perplexity {values[1]:.3f} vs {values[0]:.3f}")
    assert blocks[1] >= 1.9 * blocks[0]
    # at most one prompt splits at its first token: a near-tie (on an AMX Xeon, where bf16 prompts attend on AMX
    # tiles with bf16-rounded weights, one of 8 did, perplexity 21.255 vs 21.235). Greedy agreement is chaotic (one
    # early split halves a prompt's share): 0.49 there once prompts ran on the Q4_1 weights' bf16 copy, so the
    # bound is 0.4 and the perplexity bound below is what holds int8 K/V to the bf16 cache's quality
    assert sum(p == 0 for p in prefix) <= 1 and agreement >= 0.4
    assert 5 < values[0] < 50 and abs(values[1] / values[0] - 1) < 0.01, values


def test_block_counts_and_option_checks(tiny_llm_dir: Path) -> None:
    """At the same kv_cache_memory: int8 holds 2 * D / (D + 2) times a bf16 cache's blocks and 4 * D / (D + 2)
    a float32 one's (D = 16 here: 1.78x and 3.56x); fp8 and unknown values are refused naming the option."""
    blocks = {}
    for dtype in ("bfloat16", "float32"):
        for kv in ("auto", "int8"):
            llm = LLM(str(tiny_llm_dir), dtype=dtype, kv_cache_dtype=kv, kv_cache_memory="4MiB")
            blocks[dtype, kv] = llm.llm_engine.num_kv_blocks
            llm.shutdown()
    head_dim = 16
    for dtype, size in (("bfloat16", 2), ("float32", 4)):
        ratio = size * head_dim / (head_dim + 2)
        assert abs(blocks[dtype, "int8"] / blocks[dtype, "auto"] - ratio) < 0.02 * ratio, blocks
    for bad in ("fp8", "fp8_e4m3", "int4"):
        with pytest.raises(ValidationError, match="kv_cache_dtype") as info:
            LLM(str(tiny_llm_dir), kv_cache_dtype=bad)
        assert ("fp8 KV caches are not implemented" in str(info.value)) == bad.startswith("fp8")


def test_torch_and_cpu_backends_serve_the_same_int8_cache(tiny_llm_dir: Path) -> None:
    """The torch backend (where no compiled kernel runs) reads and writes the same int8 layout as the kernels:
    the same greedy tokens from both, float32."""
    from pagedllm import SamplingParams

    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = []
    for backend in ("torch", "cpu"):
        llm = LLM(str(tiny_llm_dir), dtype="float32", kv_cache_dtype="int8", num_kv_blocks=64,
                  attention_backend=backend)
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.shutdown()
    assert tokens[0] == tokens[1]
