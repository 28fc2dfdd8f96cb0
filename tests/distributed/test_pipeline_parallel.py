"""pipeline_parallel_size > 1 (mp and ray executors): the layers split into stages, each a worker process holding
its layers' weights and KV cache, gives what one worker gives on the same weights.

Greedy tokens under preemption (a small KV pool) with chunked prefill, prefix-cache hits, n > 1 seeded samples,
beam search, structured outputs and prompt logprobs; stages of two tensor-parallel ranks; an even split and a
given partition (``pp_layer_partition``) of a deeper model with tied embeddings (the last stage's head loaded from
the table's tensor); every stage holds only its own layers' KV (aborts leave every stage, two Ray nodes hold one
stage each, a killed stage fails the server: test_tensor_parallel.py, test_ray_cluster.py, test_faults.py); what
the stages do not run yet is refused naming the option; shutdown leaves no process.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pagedllm import LLM, EngineArgs, SamplingParams
from pagedllm.errors import ValidationError
from pagedllm.worker import memory_fit
from tests.distributed.test_tensor_parallel import (
    GREEDY,
    PROMPTS,
    SMALL_POOL,
    _run,
    check_structured_outputs_and_prompt_logprobs,
)
from tests.distributed.utils import descendants
from tests.tiny_tokenizer import save_word_tokenizer
from tests.utils import save_tiny_model


@pytest.fixture(scope="module")
def reference(tiny_llm_dir: Path) -> dict[str, Any]:
    llm = LLM(str(tiny_llm_dir), dtype="float32", max_num_batched_tokens=32, **SMALL_POOL)
    got = _run(llm)
    llm.shutdown()
    return got


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama of 5 layers with tied embeddings, and a word tokenizer of its 512 ids."""
    path = save_tiny_model(tmp_path_factory.mktemp("tiny-deep"), "llama-mha-tied", num_hidden_layers=5)
    save_word_tokenizer(path, 512)
    return path


def _layers(llm: LLM) -> list[int]:
    """KV tensors (one per layer) each worker holds, in rank order."""
    return [len(shapes) for shapes in llm.collective_rpc("kv_cache_shapes")]


def test_pp2_matches_pp1(tp_llm: Callable[..., LLM], tiny_llm_dir: Path, reference: dict,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Two stages of one layer each: every comparison of the tensor-parallel test, through 32-token chunks, with
    two batches in flight (PAGEDLLM_PP_BATCHES_IN_FLIGHT=2: each stage on its own core, the second batch taking the
    other half of the requests while the first is in the last stage)."""
    monkeypatch.setenv("PAGEDLLM_PP_BATCHES_IN_FLIGHT", "2")
    llm = tp_llm(tiny_llm_dir, pipeline_parallel_size=2, max_num_batched_tokens=32, **SMALL_POOL)
    got = _run(llm)
    assert reference["preemptions"] > 0 and got["preemptions"] > 0  # the pool was small enough to matter
    assert got["prefix_hits"] > 0
    for key in ("greedy", "shared", "sampled", "beams"):
        assert got[key] == reference[key], key
    assert _layers(llm) == [1, 1]  # the model's 2 layers, one per stage, for the same block ids
    assert [shape[1] for rank in llm.collective_rpc("kv_cache_shapes") for shape in rank] == [20, 20]
    assert llm.get_stats().max_batches_in_flight == 2


def test_stages_of_two_tensor_parallel_ranks(tp_llm: Callable[..., LLM], tiny_llm_dir: Path,
                                             reference: dict) -> None:
    """pipeline_parallel_size 2 x tensor_parallel_size 2: four workers, each stage a tensor-parallel group (its own
    collectives: shared memory within the group), each rank half of its stage's KV heads; one batch at a time
    through the stages (the default on one machine: they take turns on its cores)."""
    options = dict(pipeline_parallel_size=2, tensor_parallel_size=2, max_num_batched_tokens=32, **SMALL_POOL)
    llm = tp_llm(tiny_llm_dir, **options)
    got = _run(llm)
    for key in ("greedy", "shared", "sampled", "beams"):
        assert got[key] == reference[key], key
    assert llm.collective_rpc("kv_cache_shapes") == [[(2, 20, 1, 16, 16)]] * 4  # 1 layer, 1 of 2 KV heads each
    usage = llm.collective_rpc("memory_usage")
    planned = memory_fit.plan_ranks(*EngineArgs(model=str(tiny_llm_dir), dtype="float32", **options)
                                    .create_engine_config())  # from the shapes, before loading
    assert [(r.weights, r.kv) for r in planned] == [(u["weights_bytes"], u["kv_cache_bytes"]) for u in usage]
    tokens = llm.collective_rpc("request_token_ids")  # a stage's ranks agree; the first stage learns the last
    assert tokens[0] == tokens[1] and tokens[2] == tokens[3]  # stage's tokens with the next batch: a prefix of them
    assert all(tokens[2][r][:len(t)] == t for r, t in tokens[0].items()), (tokens[0], tokens[2])
    assert llm.get_stats().max_batches_in_flight == 1


@pytest.mark.parametrize(("pp", "partition", "layers"), [(2, "1,4", [1, 4]), (3, "2,2,1", [2, 2, 1])])
def test_stages_hold_their_layers(tp_llm: Callable[..., LLM], deep_model: Path, pp: int, partition: str | None,
                                  layers: list[int]) -> None:
    """An even split (the first stage one longer) or pp_layer_partition's; a tied head on the last stage."""
    prompts = [{"prompt_token_ids": [5 + i, 60 + 3 * i, 7, 100 + i] * (2 + i)} for i in range(5)]
    want = [o.outputs[0].token_ids for o in tp_llm(deep_model).generate(prompts, GREEDY, use_tqdm=False)]
    llm = tp_llm(deep_model, pipeline_parallel_size=pp, pp_layer_partition=partition)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert _layers(llm) == layers
    weights = [rank["weights_bytes"] for rank in llm.collective_rpc("memory_usage")]
    table = 512 * 64 * 4  # (the tiny model's vocabulary x width, float32): on the first stage and, as the head, last
    assert weights[0] > table and weights[-1] > table, weights


def test_a_model_over_one_workers_limit_serves_in_two_stages(tp_llm: Callable[..., LLM], deep_model: Path) -> None:
    """worker_memory_limit: a model whose weights alone are over what one worker may hold is refused at pp=1 before
    any worker starts (its figures, and the fewest stages that fit), and serves at pp=2 (an even split, 3 + 2
    layers, the tied head on the last stage): one worker's tokens, each stage's weights and default KV pool within
    the limit, the planned bytes of each stage the loaded ones."""
    limit = 1_000_000
    prompts = [{"prompt_token_ids": [5 + i, 60 + 3 * i, 7, 100 + i] * (2 + i)} for i in range(5)]
    one = tp_llm(deep_model)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    whole = one.collective_rpc("memory_usage")[0]["weights_bytes"]
    assert whole > limit
    before = {p.pid for p in descendants()}
    with pytest.raises(ValidationError) as refused:
        LLM(str(deep_model), dtype="float32", worker_memory_limit=limit)
    assert refused.value.param == "worker_memory_limit" and not [p for p in descendants() if p.pid not in before]
    assert f"needs {whole / 2**20:.2f} MiB for its weights" in str(refused.value)
    assert "pipeline_parallel_size=2 splits the layers" in str(refused.value)
    llm = tp_llm(deep_model, pipeline_parallel_size=2, worker_memory_limit=limit)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert _layers(llm) == [3, 2]
    usage = llm.collective_rpc("memory_usage")
    assert all(0 < u["kv_cache_bytes"] <= limit - u["weights_bytes"] for u in usage), usage
    planned = memory_fit.plan_ranks(*EngineArgs(model=str(deep_model), dtype="float32", pipeline_parallel_size=2)
                                    .create_engine_config())
    assert [r.weights for r in planned] == [u["weights_bytes"] for u in usage]


def test_structured_outputs_and_prompt_logprobs_at_pp2(tp_llm: Callable[..., LLM], tiny_llm_dir: Path) -> None:
    """The last stage masks and samples; every prompt row it scores is one worker's."""
    check_structured_outputs_and_prompt_logprobs(tp_llm, tiny_llm_dir, pipeline_parallel_size=2)


def test_stages_as_ray_actors(tp_llm: Callable[..., LLM], tiny_llm_dir: Path) -> None:
    """distributed_executor_backend "ray": each stage a Ray actor (a local cluster here), one worker's tokens."""
    prompts = PROMPTS[:4]
    want = [o.outputs[0].token_ids for o in tp_llm(tiny_llm_dir).generate(prompts, GREEDY, use_tqdm=False)]
    llm = tp_llm(tiny_llm_dir, pipeline_parallel_size=2, distributed_executor_backend="ray")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert _layers(llm) == [1, 1]


def test_data_parallel_replicas_of_two_stages(tp_llm: Callable[..., LLM], tiny_llm_dir: Path) -> None:
    """data_parallel_size 2 x pipeline_parallel_size 2: four workers, one worker's greedy tokens."""
    want = [o.outputs[0].token_ids for o in tp_llm(tiny_llm_dir).generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = tp_llm(tiny_llm_dir, pipeline_parallel_size=2, data_parallel_size=2)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
    assert _layers(llm) == [1, 1, 1, 1]


@pytest.mark.parametrize(("options", "param"), [
    (dict(pipeline_parallel_size=3), "pipeline_parallel_size"),  # 2 layers
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size"),
    (dict(pipeline_parallel_size=2, pp_layer_partition="2,0"), "pp_layer_partition"),
    (dict(pipeline_parallel_size=2, pp_layer_partition="1,x"), "pp_layer_partition"),
    (dict(pp_layer_partition="1,1"), "pp_layer_partition"),  # (no pipeline)
    (dict(pipeline_parallel_size=2, distributed_executor_backend="uni"), "distributed_executor_backend"),
    (dict(pipeline_parallel_size=2, speculative_config={"method": "ngram"}), "speculative_config"),
    (dict(pipeline_parallel_size=2, enable_prompt_embeds=True), "enable_prompt_embeds"),
    (dict(pipeline_parallel_size=2, enable_lora=True), "enable_lora"),
    (dict(pipeline_parallel_size=2, runner="pooling"), "runner"),
])
def test_what_stages_do_not_run_is_refused(tiny_llm_dir: Path, options: dict, param: str) -> None:
    """Before any worker starts (no process is left), a ValidationError naming the option."""
    before = {p.pid for p in descendants()}
    with pytest.raises(ValidationError) as err:
        LLM(str(tiny_llm_dir), **options)
    assert err.value.param == param, err.value
    assert not [p for p in descendants() if p.pid not in before]


def test_architectures_without_stages_are_refused(tiny_model: Callable[[str], Path]) -> None:
    with pytest.raises(ValidationError, match="LlamaForCausalLM") as err:
        LLM(str(tiny_model("gpt2")), pipeline_parallel_size=2)
    assert err.value.param == "pipeline_parallel_size" and "GPT2LMHeadModel" in str(err.value)


def test_shutdown_leaves_no_process(tiny_llm_dir: Path) -> None:
    before = {p.pid for p in descendants()}
    llm = LLM(str(tiny_llm_dir), dtype="float32", pipeline_parallel_size=2)
    assert len({p.pid for p in descendants()} - before) >= 2  # the stages' workers
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4), use_tqdm=False)
    llm.shutdown()
    left = [p for p in descendants() if p.pid not in before]
    assert not left, [(p.pid, p.name()) for p in left]
