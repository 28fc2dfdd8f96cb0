"""tensor_parallel_size=2 (mp and ray) gives what tensor_parallel_size=1 gives, on the same weights.

Greedy tokens under preemption (a small KV pool), with prefix-cache hits, n > 1 seeded samples and
beam search; every rank holds its share of the KV heads (half each, or the one KV head of an MQA
model replicated), every rank samples the same tokens, and shutdown leaves no process behind.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.distributed.shm_comm import SHM_ENV
from tests.distributed.utils import BACKENDS, descendants

PROMPTS = [f"Prompt number {i} says:" + " more" * i for i in range(8)]
SHARED = ["A long shared system prefix that fills more than one block of sixteen tokens, surely. " + q
          for q in ("Question one?", "Question two?", "Question three?")]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=7, ignore_eos=True)
BEAM = BeamSearchParams(beam_width=3, max_tokens=8)
SMALL_POOL = dict(num_kv_blocks=20, max_num_seqs=8)  # 8 x ~50 tokens need ~32 blocks: preemption


def _run(llm: LLM) -> dict[str, Any]:
    """Everything the comparison looks at, from one engine."""
    greedy = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    preemptions = llm.get_stats().num_preemptions
    shared = [o.outputs[0].token_ids for o in llm.generate(SHARED, GREEDY, use_tqdm=False)]
    sampled = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[:3], SAMPLED, use_tqdm=False)]
    beams = [[s.tokens for s in o.sequences] for o in llm.beam_search(PROMPTS[:2], BEAM)]
    return dict(greedy=greedy, shared=shared, sampled=sampled, beams=beams, preemptions=preemptions,
                prefix_hits=llm.get_stats().prefix_cache_hits)


@pytest.fixture(scope="module")
def reference(tiny_llm_dir: Path) -> dict[str, Any]:
    llm = LLM(str(tiny_llm_dir), dtype="float32", **SMALL_POOL)
    return _run(llm)


@pytest.mark.parametrize("backend", [*BACKENDS, "mp-gloo"])
def test_tp2_matches_tp1(tp_llm: Callable[..., LLM], tiny_llm_dir: Path, reference: dict, backend: str,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    """mp and ray on one machine all-reduce through shared memory; mp-gloo through gloo's TCP."""
    if backend == "mp-gloo":
        monkeypatch.setenv(SHM_ENV, "0")  # the spawned workers inherit it
        backend = "mp"
    llm = tp_llm(tiny_llm_dir, tensor_parallel_size=2, distributed_executor_backend=backend, **SMALL_POOL)
    got = _run(llm)
    assert reference["preemptions"] > 0 and got["preemptions"] > 0  # the pool was small enough to matter
    assert got["prefix_hits"] > 0
    for key in ("greedy", "shared", "sampled", "beams"):
        assert got[key] == reference[key], key
    # every rank holds half of the 2 KV heads of every layer, for the same block ids
    shapes = llm.llm_engine.engine_core.core.executor.collective_rpc("kv_cache_shapes")
    assert all(shape == (2, 20, 1, 16, 16) for rank in shapes for shape in rank), shapes


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_sample_the_same_tokens(tp_llm: Callable[..., LLM], tiny_llm_dir: Path, backend: str) -> None:
    llm = tp_llm(tiny_llm_dir, tensor_parallel_size=2, distributed_executor_backend=backend)
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True))
    for _ in range(10):
        engine.step()
    rank0, rank1 = engine.engine_core.core.executor.collective_rpc("request_token_ids")
    assert len(rank0) == 4 and rank0 == rank1


@pytest.mark.parametrize("backend", BACKENDS)
def test_replicated_kv_head_and_padded_vocabulary(tp_llm: Callable[..., LLM], mqa_model_dir: Path,
                                                  backend: str) -> None:
    prompts = [{"prompt_token_ids": [1 + i, 40 + i, 7, 300 + i, 512]} for i in range(8)]
    want = [o.outputs[0].token_ids for o in tp_llm(mqa_model_dir).generate(prompts, GREEDY, use_tqdm=False)]
    llm = tp_llm(mqa_model_dir, tensor_parallel_size=2, distributed_executor_backend=backend)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    # one KV head, on both ranks; each rank holds 2 of the 4 query heads
    for rank in llm.llm_engine.engine_core.core.executor.collective_rpc("kv_cache_shapes"):
        assert all(shape[2] == 1 for shape in rank)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shutdown_leaves_no_process(tp_llm: Callable[..., LLM], tiny_llm_dir: Path, backend: str) -> None:
    before = {p.pid for p in descendants()}
    llm = LLM(str(tiny_llm_dir), dtype="float32", tensor_parallel_size=2, distributed_executor_backend=backend)
    assert len({p.pid for p in descendants()} - before) >= 2  # the workers (and a local Ray cluster)
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4), use_tqdm=False)
    llm.shutdown()
    llm.shutdown()  # idempotent
    left = [p for p in descendants() if p.pid not in before]
    assert not left, [(p.pid, p.name()) for p in left]


@pytest.mark.parametrize("option", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_aborted_requests_leave_every_rank(tp_llm: Callable[..., LLM], tiny_llm_dir: Path, option: str) -> None:
    """Two ranks, or two pipeline stages (the first takes the tokens the last sampled with the next batch: a prefix
    of the last stage's)."""
    llm = tp_llm(tiny_llm_dir, **{option: 2})
    engine = llm.llm_engine
    for i in range(3):
        engine.add_request(f"drop{i}", PROMPTS[i], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    first, second = llm.collective_rpc("request_token_ids")
    assert len(first) == len(second) == 3 and all(second[r][:len(t)] == t for r, t in first.items())
    assert first == second or option == "pipeline_parallel_size"
    engine.abort_request([f"drop{i}" for i in range(3)])
    assert engine.get_stats().kv_cache_usage == 0.0  # the one pool every rank's blocks mirror
    engine.add_request("next", PROMPTS[4], SamplingParams(max_tokens=2))
    engine.step()  # the workers hear of the aborts with the next step
    assert [sorted(req.split(":", 1)[1] for req in rank) for rank in llm.collective_rpc("request_token_ids")] == \
        [["next"], ["next"]]


def test_structured_outputs_and_prompt_logprobs_at_tp2(tp_llm: Callable[..., LLM], tiny_llm_dir: Path) -> None:
    """Every rank masks with its own matcher (the same tokens), and prompt rows are scored across ranks."""
    check_structured_outputs_and_prompt_logprobs(tp_llm, tiny_llm_dir, tensor_parallel_size=2)


def check_structured_outputs_and_prompt_logprobs(tp_llm: Callable[..., LLM], path: Path, **options: Any) -> None:
    """Seeded samples under a choice grammar and prompt logprobs of an engine with ``options``: one worker's."""
    from pagedllm import StructuredOutputsParams
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=4, prompt_logprobs=1,
                            structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue"]))
    one = tp_llm(path).generate("Color:", params, use_tqdm=False)[0]
    two = tp_llm(path, **options).generate("Color:", params, use_tqdm=False)[0]
    assert [c.text for c in two.outputs] == [c.text for c in one.outputs]
    assert all(c.text in ("red", "green", "blue") for c in two.outputs)
    for a, b, token in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:], one.prompt_token_ids[1:]):
        assert abs(a[token].logprob - b[token].logprob) < 1e-4


@pytest.mark.parametrize("variant", ["gpt2", "opt-350m-style", "qwen3-qk-norm", "mixtral", "qwen2-moe", "gemma2"])
def test_other_families_at_tp2(tp_llm: Callable[..., LLM], tiny_model: Callable, variant: str) -> None:
    """GPT-2 (packed Conv1D qkv), OPT (replicated projections in and out), Qwen3 (q/k norms) and the
    mixtures of experts (each expert's intermediate size split) across two ranks give one rank's tokens."""
    path = tiny_model(variant)
    prompts = [{"prompt_token_ids": [5 + i, 60 + 3 * i, 7, 100 + i] * (1 + i)} for i in range(4)]
    want = [o.outputs[0].token_ids for o in tp_llm(path).generate(prompts, GREEDY, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in tp_llm(path, tensor_parallel_size=2).generate(prompts, GREEDY,
                                                                                           use_tqdm=False)]
    assert got == want


@pytest.mark.slow
def test_quantized_default_model_at_tp2(tp_llm: Callable[..., LLM], tokenizer: Any) -> None:
    """The default model (quantization="gguf") across two ranks: each rank keeps its share of the Q4_1 / Q8_0 rows
    (the splits fall on block edges: heads 6 + 3 of 64 columns, the MLP's 768 + 768), and the greedy tokens are
    one rank's (the row-parallel sums only add in another order). The tiny models' tp tests compare every family
    and both executors exactly."""
    from tests.models.smollm_prompts import smollm_prompt_ids

    prompts = [{"prompt_token_ids": ids} for ids in smollm_prompt_ids(tokenizer)[:6]]
    params = SamplingParams(max_tokens=16, temperature=0)
    one = tp_llm(None, quantization="gguf")
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    whole = one.llm_engine.engine_core.core.executor.collective_rpc("memory_usage")[0]["weights_bytes"]
    two = tp_llm(None, quantization="gguf", tensor_parallel_size=2)
    assert [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)] == want
    shares = [rank["weights_bytes"] for rank in two.llm_engine.engine_core.core.executor.collective_rpc("memory_usage")]
    assert all(share < 0.7 * whole for share in shares) and sum(shares) < 1.1 * whole, (shares, whole)
    heads = [rank[0][2] for rank in two.llm_engine.engine_core.core.executor.collective_rpc("kv_cache_shapes")]
    assert heads == [2, 1]  # SmolLM2's 3 KV heads split 2 + 1 (9 query heads: 6 + 3)
