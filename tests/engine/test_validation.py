"""Bad input raises ValidationError naming the parameter and value; nothing leaks afterwards."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams, ValidationError
from pagedllm.config import parse_cuda_graph_sizes
from tests.utils import assert_pool_clean

LLM_OPTIONS = dict(max_model_len=64, num_kv_blocks=32, block_size=4)
"""The module's shared ``llm`` (tests/engine/conftest.py)."""


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.1), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(n=0), "n"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logprobs=-2), "logprobs"),  # (-1: every token, as vLLM)
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_sampling_params_refused(kwargs: dict, param: str) -> None:
    with pytest.raises(ValidationError) as err:
        SamplingParams(**kwargs)
    value = next(iter(kwargs.values())) if len(kwargs) == 1 else kwargs[param]
    assert err.value.param == param and param in str(err.value) and repr(value) in str(err.value)


def test_empty_prompt(llm: LLM) -> None:
    with pytest.raises(ValidationError, match="prompt") as err:
        llm.generate("", use_tqdm=False)
    assert err.value.param == "prompt"
    assert_pool_clean(llm)


def test_token_ids_outside_vocabulary(llm: LLM) -> None:
    vocab = llm.llm_engine.processor.vocab_size
    with pytest.raises(ValidationError, match=str(vocab)) as err:
        llm.generate({"prompt_token_ids": [5, vocab]}, use_tqdm=False)
    assert err.value.param == "prompt_token_ids" and err.value.value == vocab
    with pytest.raises(ValidationError):
        llm.generate({"prompt_token_ids": [5, -1]}, use_tqdm=False)
    assert_pool_clean(llm)


def test_prompt_too_long_names_both_lengths(llm: LLM) -> None:
    with pytest.raises(ValidationError) as err:
        llm.generate({"prompt_token_ids": [5] * 70}, use_tqdm=False)
    assert "70" in str(err.value) and "64" in str(err.value)
    with pytest.raises(ValidationError) as err:
        llm.generate({"prompt_token_ids": [5] * 60}, SamplingParams(max_tokens=10), use_tqdm=False)
    assert err.value.param == "max_tokens" and "70" in str(err.value) and "64" in str(err.value)
    assert_pool_clean(llm)


def test_refused_request_in_a_batch_leaves_nothing_behind(llm: LLM) -> None:
    """The good prompts queued before the bad one are withdrawn too; then the engine still works."""
    with pytest.raises(ValidationError):
        llm.generate(["hello", "world", ""], use_tqdm=False)
    assert_pool_clean(llm)
    out = llm.generate(["hello"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert_pool_clean(llm)


def test_request_larger_than_the_pool(make_llm: Callable[..., LLM]) -> None:
    small = make_llm(max_model_len=64, num_kv_blocks=5, block_size=4)
    with pytest.raises(ValidationError, match="pool") as err:
        small.generate({"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=20), use_tqdm=False)
    assert err.value.param == "max_tokens"
    assert_pool_clean(small)


def test_logprobs_beyond_the_limit(llm: LLM) -> None:
    with pytest.raises(ValidationError) as err:
        llm.generate("hi", SamplingParams(logprobs=21), use_tqdm=False)
    assert err.value.param == "logprobs"


def test_unknown_llm_option(tiny_llm_dir: Path) -> None:
    with pytest.raises(ValidationError) as err:
        LLM(str(tiny_llm_dir), max_num_seq=8)
    assert err.value.param == "max_num_seq" and "max_num_seq" in str(err.value)


@pytest.mark.parametrize("kwargs, param", [
    (dict(dtype="float64"), "dtype"), (dict(block_size=0), "block_size"),
    (dict(kv_cache_memory="lots"), "kv_cache_memory"),
    (dict(max_model_len=100000), "max_model_len"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size"), (dict(tensor_parallel_size=3), "tensor_parallel_size"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "distributed_executor_backend"),
    (dict(distributed_executor_backend="threads"), "distributed_executor_backend"),
    (dict(device="gpu"), "device"), (dict(gpu_memory_utilization=0), "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(model="/nonexistent/model"), "model"), (dict(enforce_eager="yes"), "enforce_eager"),
    (dict(cuda_graph_sizes="1,x"), "cuda_graph_sizes"), (dict(cuda_graph_sizes=[0, 8]), "cuda_graph_sizes"),
    (dict(cuda_graph_sizes="512"), "cuda_graph_sizes"), (dict(cuda_graph_sizes=""), "cuda_graph_sizes"),
    (dict(load_format="pt"), "load_format"),
])
def test_bad_engine_options(tiny_llm_dir: Path, kwargs: dict, param: str) -> None:
    kwargs.setdefault("model", str(tiny_llm_dir))
    with pytest.raises(ValidationError) as err:
        LLM(**kwargs)
    assert err.value.param == param


def test_cuda_graph_ladder() -> None:
    """1, 2, 4, then multiples of 8 up to min(max_num_seqs, 256), max_num_seqs itself included."""
    default = parse_cuda_graph_sizes(None, 256)
    assert default[:5] == (1, 2, 4, 8, 16) and default[-1] == 256 and len(default) == 35
    assert parse_cuda_graph_sizes(None, 20) == (1, 2, 4, 8, 16, 20)
    assert parse_cuda_graph_sizes(None, 1000)[-1] == 256
    assert parse_cuda_graph_sizes(" 8, 1,4,8", 16) == (1, 4, 8) == parse_cuda_graph_sizes([4, 1, 8], 16)


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature="0.5"), "temperature"), (dict(top_p=None), "top_p"), (dict(n=True), "n"),
    (dict(stop=5), "stop"), (dict(stop_token_ids=7), "stop_token_ids"), (dict(ignore_eos="no"), "ignore_eos"),
    (dict(max_tokens=2.5), "max_tokens"), (dict(seed="x"), "seed"),
])
def test_sampling_params_wrong_types(kwargs: dict, param: str) -> None:
    with pytest.raises(ValidationError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


@pytest.mark.parametrize("kwargs, param", [
    (dict(kv_cache_memory="1KiB"), "kv_cache_memory"), (dict(max_model_len=0), "max_model_len"),
    (dict(max_model_len="100"), "max_model_len"), (dict(seed="x"), "seed"),
])
def test_bad_engine_option_values(tiny_llm_dir: Path, kwargs: dict, param: str) -> None:
    with pytest.raises(ValidationError) as err:
        LLM(str(tiny_llm_dir), **kwargs)
    assert err.value.param == param


def test_generate_refuses_non_prompts(llm: LLM) -> None:
    with pytest.raises(ValidationError):
        llm.generate(None, use_tqdm=False)
    with pytest.raises(ValidationError) as err:
        llm.generate("hi", [{"temperature": 0}], use_tqdm=False)
    assert err.value.param == "sampling_params"
    assert_pool_clean(llm)


def test_user_ids_cannot_collide_with_sample_ids(llm: LLM) -> None:
    """n>1 samples get engine-internal ids: a user id shaped like one of them is just another id."""
    engine = llm.llm_engine
    engine.add_request("1_y", "first", SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request("y", "second", SamplingParams(n=2, max_tokens=2, ignore_eos=True, temperature=1.0))
    with pytest.raises(ValidationError) as err:
        engine.add_request("y", "again", SamplingParams(max_tokens=2))
    assert err.value.param == "request_id"
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(done) == ["1_y", "y"] and len(done["y"].outputs) == 2
    assert_pool_clean(llm)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_is_refused(tiny_llm_dir: Path) -> None:
    with pytest.raises(ValidationError) as err:
        LLM(str(tiny_llm_dir), device="cuda")
    assert err.value.param == "device" and "no CUDA device" in str(err.value)
