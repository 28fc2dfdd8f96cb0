"""The offline API end to end on a tiny random model with a real tokenizer."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams, ValidationError
from tests.utils import assert_pool_clean, model_of, worker_of

LLM_OPTIONS = dict(num_kv_blocks=256, block_size=16)
"""The module's shared ``llm`` (tests/engine/conftest.py)."""


def test_outputs_in_input_order_with_vllm_fields(llm: LLM) -> None:
    prompts = ["first prompt", {"prompt_token_ids": [10, 20, 30]}, "third one here"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outs] == ["first prompt", None, "third one here"]
    assert outs[1].prompt_token_ids == [10, 20, 30]
    for o in outs:
        c = o.outputs[0]
        assert o.finished and c.index == 0 and len(c.token_ids) == 5 and c.finish_reason == "length"
        assert c.cumulative_logprob is None and c.logprobs is None and c.stop_reason is None
        full = llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)
        assert c.text == full.rstrip("\ufffd")  # an unfinished multi-byte character at the end is held back


def test_default_max_tokens_is_16(llm: LLM) -> None:
    out = llm.generate("hello", SamplingParams(ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 16


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    alone = llm.generate("a seeded prompt", seeded, use_tqdm=False)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(["other", "a seeded prompt", "more other text"], [noise, seeded, noise], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    unseeded = llm.generate(["a seeded prompt"] * 2, noise, use_tqdm=False)
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_n_samples(llm: LLM) -> None:
    out = llm.generate("sample me", SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    again = llm.generate("sample me", SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_logprobs(llm: LLM) -> None:
    c = llm.generate("log probs", SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True),
                     use_tqdm=False)[0].outputs[0]
    assert len(c.logprobs) == 4
    for token_id, entry in zip(c.token_ids, c.logprobs):
        assert token_id in entry and entry[token_id].rank == 1  # greedy picks the top token
        assert len(entry) == 3 and sorted(e.rank for e in entry.values()) == [1, 2, 3]
        assert all(e.decoded_token is not None for e in entry.values())
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))


def test_stop_token_ids_and_stop_strings(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    base = llm.generate("stop test", greedy, use_tqdm=False)[0].outputs[0]
    stop_id = base.token_ids[3]
    c = llm.generate("stop test", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                 stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    first = base.token_ids.index(stop_id)
    assert c.token_ids == base.token_ids[: first + 1] and c.finish_reason == "stop" and c.stop_reason == stop_id
    stop_str = base.text[len(base.text) // 2: len(base.text) // 2 + 3]
    if stop_str.strip():
        c = llm.generate("stop test", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop=stop_str),
                         use_tqdm=False)[0].outputs[0]
        assert c.text == base.text[: base.text.index(stop_str)] and c.stop_reason == stop_str
    assert not llm.llm_engine.has_unfinished_requests()


def test_min_tokens_defers_stop_token_ids(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    base = llm.generate("eos test", greedy, use_tqdm=False)[0].outputs[0]
    c = llm.generate("eos test", SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6,
                                                stop_token_ids=base.token_ids[:1]), use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) == 6 and base.token_ids[0] not in c.token_ids  # masked until min_tokens


def test_abort_frees_everything(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("x", "abort me", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("y", "keep me", SamplingParams(max_tokens=3, ignore_eos=True))
    seq_ids = engine.output_processor.seq_ids("x") + engine.output_processor.seq_ids("y")
    engine.step()
    engine.step()
    engine.abort_request("x")
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["y"]
    assert_pool_clean(llm)
    engine.add_request("z", "next one", SamplingParams(max_tokens=1))
    z_ids = engine.output_processor.seq_ids("z")
    engine.step()  # the next real step tells the worker what finished since the last one
    worker_states = set(worker_of(engine).model_runner.requests)
    assert worker_states == set(z_ids) and not worker_states & set(seq_ids)  # the worker dropped both states


def test_an_idle_engine_runs_no_step(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finished ids ride on the next real step: nothing runs between two generate() calls."""
    engine = llm.llm_engine
    batches = []
    run = engine.engine_core.core.executor.execute_model
    monkeypatch.setattr(engine.engine_core.core.executor, "execute_model", lambda out: batches.append(out) or run(out))
    first = llm.generate("one", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert all(not out.is_empty for out in batches) and len(batches) == 2
    (first_id,) = {r.req_id for r in batches[0].scheduled_new_reqs}
    llm.generate("two", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert all(not out.is_empty for out in batches) and len(batches) == 4
    runner = worker_of(engine).model_runner
    assert first_id in batches[2].finished_req_ids and first_id not in runner.requests
    assert first[0].outputs[0].token_ids and not engine.has_unfinished_requests()


def test_chat_applies_the_template(llm: LLM) -> None:
    convs = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "bye"}]]
    outs = llm.chat(convs, SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(outs) == 2 and outs[0].prompt.startswith("<|im_start|>") and outs[0].prompt.endswith("assistant\n")
    assert outs[0].prompt_token_ids[0] == llm.get_tokenizer().convert_tokens_to_ids("<|im_start|>")


def test_engine_statistics(llm: LLM) -> None:
    llm.generate(["a"] * 5, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_steps > 0 and stats.max_num_running >= 5 and stats.num_kv_blocks == 256
    assert 0 < stats.max_kv_cache_usage <= 1 and stats.kv_cache_usage == 0


def test_kv_cache_memory_sizes_the_pool(make_llm: Callable[..., LLM]) -> None:
    """Blocks = bytes // (2 * layers * block_size * kv_heads * head_dim * dtype size)."""
    llm = make_llm(kv_cache_memory="1MiB", block_size=16)
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # tiny model: 2 layers, 2 KV heads of 16 dims, float32
    assert llm.get_stats().num_kv_blocks == (1 << 20) // per_block


def test_every_eos_id_of_generation_config_stops(make_llm: Callable[..., LLM], tiny_llm_dir: Path,
                                                 tmp_path: Path) -> None:
    """Llama-3 style checkpoints list several EOS ids in generation_config.json: any of them stops."""
    import json
    import shutil

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    free = make_llm(num_kv_blocks=64).generate("stop here", greedy, use_tqdm=False)
    tokens = free[0].outputs[0].token_ids
    extra = next(t for t in tokens[2:] if t not in tokens[:2])  # a token first generated at step >= 2
    folder = tmp_path / "model"
    shutil.copytree(tiny_llm_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, extra]}))
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64)
    assert llm.llm_engine.processor.eos_token_ids[-1] == extra
    out = llm.generate("stop here", SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids == tokens[:tokens.index(extra) + 1]
    ignored = llm.generate("stop here", greedy, use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == tokens  # ignore_eos ignores every EOS id


def test_float16_runs_at_every_level(make_llm: Callable[..., LLM], level: str) -> None:
    """float16 checkpoints load and run: stored as float16, computed in float32 in the kernels (torch's
    own float16 ops at the portable level); greedy tokens as float32's on this tiny model."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {dtype: make_llm(dtype=dtype, num_kv_blocks=64).generate(
        "half precision", params, use_tqdm=False)[0].outputs[0].token_ids for dtype in ("float16", "float32")}
    assert len(tokens["float16"]) == 6
    assert tokens["float16"][:3] == tokens["float32"][:3]


def test_dummy_load_format_reads_no_weights(tiny_llm_dir: Path, tmp_path: Path) -> None:
    """load_format="dummy": only config.json and the tokenizer are read (the checkpoint may be absent);
    weights are drawn from the seed in [-1e-3, 1e-3], norms 1; the engine generates as usual."""
    import shutil

    for f in tiny_llm_dir.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, tmp_path / f.name)
    with pytest.raises(ValidationError, match=r"no \*\.safetensors files"):
        LLM(str(tmp_path), dtype="float32", num_kv_blocks=32)  # no checkpoint: the default format fails
    runs = []
    for _ in range(2):
        llm = LLM(str(tmp_path), load_format="dummy", dtype="float32", num_kv_blocks=32, seed=3)
        model = model_of(llm)
        for name, p in model.named_parameters():
            if p.numel() == 0:  # packed for the CPU kernels: the packed copy replaced it
                continue
            if "norm" in name:
                assert bool((p == 1).all()), name
            else:
                assert 0 < float(p.abs().max()) <= 1.0001e-3, name  # float32 rounding of 1e-3
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=6, ignore_eos=True),
                           use_tqdm=False)
        runs.append((out[0].outputs[0].token_ids, [p.clone() for p in model.parameters()]))
        llm.shutdown()
    assert len(runs[0][0]) == 6 and runs[0][0] == runs[1][0]
    assert all(bool((a == b).all()) for a, b in zip(runs[0][1], runs[1][1]))  # the same seed, the same weights


def test_dummy_weights_make_every_norm_the_identity() -> None:
    """Norms are found by module, not by parameter name: BERT's "LayerNorm" and GPT-2's "ln_1" get weight 1 and
    bias 0, Gemma's offset-from-1 weight 0; everything else is drawn in [-1e-3, 1e-3]."""
    import torch

    from pagedllm.layers.norm import GemmaRMSNorm, LayerNorm, RMSNorm
    from pagedllm.worker.worker import _fill_dummy_weights

    model = torch.nn.Module()
    model.LayerNorm = LayerNorm(8, dtype=torch.float32)
    model.ln_1 = LayerNorm(8, dtype=torch.float32)
    model.input_layernorm = RMSNorm(8, dtype=torch.float32)
    model.gemma_norm = GemmaRMSNorm(8, 1e-6, torch.float32)
    model.dense = torch.nn.Linear(8, 8)
    for p in model.parameters():
        torch.nn.init.constant_(p, 5.0)
    _fill_dummy_weights(model, seed=0)
    for norm in (model.LayerNorm, model.ln_1):
        assert bool((norm.weight == 1).all()) and bool((norm.bias == 0).all())
    assert bool((model.input_layernorm.weight == 1).all()) and bool((model.gemma_norm.weight == 0).all())
    for p in model.dense.parameters():
        assert 0 < float(p.detach().abs().max()) <= 1.0001e-3
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    plain = torch.nn.functional.layer_norm(x, (8,), eps=model.LayerNorm.eps)  # the same eps: no weight, no bias
    assert torch.allclose(model.LayerNorm.forward_native(x), plain, atol=1e-5)
