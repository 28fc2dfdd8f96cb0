"""The compiled decoder stack (models/cpu_stack.py) equals the layers run one by one, bit for bit,
at every kernel level this CPU runs and for every storage dtype."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.models.cpu_stack import CpuDecoderStack
from tests.utils import model_of, save_tiny_model

VARIANTS = ["llama-gqa-untied", "qwen2-qkv-bias", "llama-attention-bias"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> dict[str, Path]:
    """Tiny random models of the variants with biases, with the default model's tokenizer."""
    return {v: save_tiny_model(tmp_path_factory.mktemp(v), v, vocab_size=len(tokenizer), tokenizer=tokenizer)
            for v in VARIANTS}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_stack_equals_the_layer_by_layer_path(kernels, models: dict[str, Path], variant: str, dtype: str) -> None:
    assert_stack_equals_the_layers(LLM(str(models[variant]), dtype=dtype, num_kv_blocks=64,
                                       enable_prefix_caching=False))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_with_the_int8_kv_cache(kernels, models: dict[str, Path], dtype: str) -> None:
    assert_stack_equals_the_layers(LLM(str(models["llama-gqa-untied"]), dtype=dtype, num_kv_blocks=64,
                                       enable_prefix_caching=False, kv_cache_dtype="int8"))


def assert_stack_equals_the_layers(llm: LLM) -> None:
    """The same prompts (prompts and decodes in one step) through the stack, then through the layers one by one:
    the same tokens and the same log-probability floats. Shuts ``llm`` down."""
    model = model_of(llm).model
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]  # prompts and decodes in one step
    stacked = llm.generate(prompts, params, use_tqdm=False)
    assert model._stack is not None, "every piece runs on the kernels here: the stack should have served"
    model._stack = None  # from now on, the layers one by one
    plain = llm.generate(prompts, params, use_tqdm=False)
    llm.shutdown()
    for a, b in zip(stacked, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # the same floats, not just close ones


def test_no_stack_where_a_piece_is_not_compiled(tiny_llm_dir: Path) -> None:
    from pagedllm.layers import cpu_ops

    with cpu_ops.use_level("portable"):
        llm = LLM(str(tiny_llm_dir), dtype="float32", num_kv_blocks=64)
        llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)
    assert model_of(llm).model._stack is None


@pytest.mark.parametrize("variant", ["llama-gqa-untied", "qwen2-qkv-bias"])
def test_stack_with_weights_on_amx_tiles(models: dict[str, Path], variant: str) -> None:
    """At the "amx" level bf16 weights stay plain for the AMX GEMM: the stack runs the steps of up to 32 rows (the
    decodes) on it, larger ones (the 60-row first step) go layer by layer; the same floats as the layers."""
    from pagedllm import platform

    if platform.isa_level() != "amx":
        pytest.skip("AMX tiles: this CPU (or PAGEDLLM_ISA) has no amx level")
    with platform.use_level("amx"):
        llm = LLM(str(models[variant]), dtype="bfloat16", num_kv_blocks=64, enable_prefix_caching=False)
    model = model_of(llm).model
    assert model.layers[0].self_attn.qkv_proj.packed_weight.amx  # the plain weight, for AMX tiles
    if model._stack is False:  # built at the first step, unless warm-up ran one
        model._stack = CpuDecoderStack.build(model)
    stack, served = model._stack, []
    assert stack is not None and stack.max_rows == 32
    run = stack.run
    stack.run = lambda hidden, positions: served.append(hidden.shape[0]) or run(hidden, positions)
    assert_stack_equals_the_layers(llm)
    assert served and max(served) <= 32, served  # the decodes ran in the stack, the 60-row prefill did not


def test_the_stack_follows_the_pools_through_sleep_and_wake(kernels, models: dict[str, Path]) -> None:
    """A wake-up after sleep allocates new KV pools: the stack (which holds the pools' addresses) is built again
    for them, never left writing into the freed ones; the same tokens as before the sleep."""
    import torch

    llm = LLM(str(models["llama-gqa-untied"]), dtype="bfloat16", num_kv_blocks=64, enable_sleep_mode=True)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    before = llm.generate(["Hello there, how are"], params, use_tqdm=False)[0].outputs[0].token_ids
    model = model_of(llm).model
    assert model._stack, "the stack served"
    llm.sleep(1)
    taken = [torch.ones(n) for n in (1024, 4096, 16384, 65536, 262144) for _ in range(200)]  # the freed memory
    llm.wake_up()
    after = llm.generate(["Hello there, how are"], params, use_tqdm=False)[0].outputs[0].token_ids
    pool = model.layers[0].self_attn.attn.kv_cache
    assert model._stack and model._stack.plan.layer[0].k_cache == pool[0].data_ptr()
    assert after == before and all(t.eq(1).all() for t in taken)  # (nothing wrote into what the pools had)
    llm.shutdown()
