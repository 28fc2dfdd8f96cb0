"""LoRA adapters: outputs equal transformers + peft's merged model; mixed-adapter batches equal
each request alone; the prefix cache never mixes adapters; bad adapters are refused by name."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pagedllm import LLM, LoRARequest, SamplingParams, ValidationError
from tests.lora.utils import greedy_reference
from tests.utils import worker_of

PROMPTS = [[1 + i, 50 + 7 * i, 9, 300 + i, 17, 2 * i + 3] * (1 + i % 3) for i in range(6)]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def lora_llm(tiny_llm_dir: Path) -> Any:
    llm = LLM(str(tiny_llm_dir), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              num_kv_blocks=128, block_size=16)
    yield llm
    llm.shutdown()


def _tokens(llm: LLM, prompts: list[list[int]], lora: Any = None) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=lora)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", ["all-r8", "qv-r4-rslora", "mlp-r16"])
def test_adapter_equals_the_merged_peft_model(lora_llm: LLM, adapters: Callable, name: str) -> None:
    folder, merged = adapters(name)
    lora = LoRARequest(name, 1 + ["all-r8", "qv-r4-rslora", "mlp-r16"].index(name), str(folder))
    got = _tokens(lora_llm, PROMPTS, lora)
    want = [greedy_reference(merged, p, GREEDY.max_tokens) for p in PROMPTS]
    assert got == want
    assert got != _tokens(lora_llm, PROMPTS)  # the adapter changes the tokens: the comparison means something


def test_mixed_adapters_in_one_batch_equal_each_alone(tiny_llm_dir: Path, adapters: Callable) -> None:
    """Two adapters and the base model in the same steps (max_loras=2): every request gets the tokens it
    gets alone; with max_loras=1 the scheduler runs one adapter at a time and the tokens are the same."""
    a = LoRARequest("a", 1, str(adapters("all-r8")[0]))
    b = LoRARequest("b", 2, str(adapters("attn-r2")[0]))
    loras = [a, b, None, a, None, b]
    for max_loras in (2, 1):
        llm = LLM(str(tiny_llm_dir), dtype="float32", enable_lora=True, max_loras=max_loras, max_lora_rank=8,
                  num_kv_blocks=128, block_size=16)
        alone = [_tokens(llm, [p], lora)[0] for p, lora in zip(PROMPTS, loras)]
        runner = worker_of(llm).model_runner
        seen: list[int] = []
        prepare = runner.lora.prepare

        def spy(step_loras: list, qsl: list, seen: list[int] = seen, prepare=prepare) -> bool:  # adapters per step
            seen.append(len({lo.lora_int_id for lo in step_loras if lo is not None}))
            return prepare(step_loras, qsl)

        runner.lora.prepare = spy
        together = _tokens(llm, PROMPTS, loras)
        llm.shutdown()
        assert together == alone
        assert max(seen) == max_loras  # several adapters shared a step (2), or never did (1)
    assert len({tuple(t) for t in alone[:3]}) == 3


def test_prefix_cache_keys_include_the_adapter(lora_llm: LLM, adapters: Callable) -> None:
    """The same prompt under an adapter and without: neither reuses the other's K/V; the same adapter does."""
    lora = LoRARequest("all-r8", 1, str(adapters("all-r8")[0]))
    prompt = [[7 + (i % 50) for i in range(40)]]  # two full blocks of 16
    base_first = _tokens(lora_llm, prompt)
    hits = lora_llm.get_stats().prefix_cache_hits
    with_lora = _tokens(lora_llm, prompt, lora)
    assert lora_llm.get_stats().prefix_cache_hits == hits  # no hit on the base model's blocks
    again = _tokens(lora_llm, prompt, lora)
    assert lora_llm.get_stats().prefix_cache_hits > hits and again == with_lora  # its own blocks: hits
    assert _tokens(lora_llm, prompt) == base_first != with_lora


def test_n_samples_and_beam_search_run_the_adapter(lora_llm: LLM, adapters: Callable, tiny_llm_dir: Path,
                                                   tmp_path: Path) -> None:
    """Forked samples keep their leader's adapter; beam search under the adapter equals beam search on the
    merged weights saved as a plain model."""
    from pagedllm import BeamSearchParams

    folder, merged = adapters("all-r8")
    lora = LoRARequest("all-r8", 1, str(folder))
    want = greedy_reference(merged, PROMPTS[1], 6)
    outs = lora_llm.generate({"prompt_token_ids": PROMPTS[1]}, SamplingParams(n=3, max_tokens=6, temperature=0.0,
                                                                               ignore_eos=True),
                             use_tqdm=False, lora_request=lora)
    assert [c.token_ids for c in outs[0].outputs] == [want] * 3
    merged.save_pretrained(tmp_path)
    lora_llm.get_tokenizer().save_pretrained(tmp_path)
    plain = LLM(str(tmp_path), dtype="float32", num_kv_blocks=128, block_size=16)
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    want_beams = [[s.tokens for s in o.sequences] for o in plain.beam_search(prompts, params, use_tqdm=False)]
    plain.shutdown()
    got = [[s.tokens for s in o.sequences] for o in lora_llm.beam_search(prompts, params, use_tqdm=False,
                                                                           lora_request=lora)]
    assert got == want_beams


def test_bad_adapters_are_refused_by_name(lora_llm: LLM, tiny_llm_dir: Path, adapters: Callable,
                                          tmp_path: Path) -> None:
    import json
    import shutil

    folder = adapters("attn-r2")[0]
    cases: list[tuple[Any, str]] = [(LoRARequest("nope", 40, str(tmp_path / "missing")), "adapter_config.json")]
    big = tmp_path / "big"
    shutil.copytree(adapters("mlp-r16")[0], big)
    small_engine = LLM(str(tiny_llm_dir), dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=32)
    with pytest.raises(ValidationError) as err:
        small_engine.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("big", 41, str(big)))
    assert err.value.param == "lora_request" and "max_lora_rank=8" in str(err.value)
    small_engine.shutdown()
    for field, value, why in [("bias", "all", "bias"), ("modules_to_save", ["lm_head"], "modules_to_save"),
                              ("use_dora", True, "use_dora"), ("init_lora_weights", "pissa_niter_4", "pissa"),
                              ("init_lora_weights", "olora", "path_initial_model_for_weight_conversion")]:
        bad = tmp_path / f"{field}-{value}"
        shutil.copytree(folder, bad)
        config = json.loads((bad / "adapter_config.json").read_text())
        config[field] = value
        (bad / "adapter_config.json").write_text(json.dumps(config))
        cases.append((LoRARequest(f"{field}-{len(cases)}", 42 + len(cases), str(bad)), why))
    for lora, why in cases:
        with pytest.raises(ValidationError) as err:
            lora_llm.generate("hi", GREEDY, use_tqdm=False, lora_request=lora)
        assert err.value.param == "lora_request" and why in str(err.value)
    with pytest.raises(ValidationError) as err:  # an id is one adapter
        lora_llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("other", 1, str(folder)))
    assert err.value.param == "lora_request"
    assert lora_llm.llm_engine.engine_core.core.scheduler.requests == {}  # nothing refused stayed queued
    with pytest.raises(ValidationError) as err:
        LoRARequest("x", 0, str(folder))
    assert err.value.param == "lora_request.lora_int_id"


def test_lora_needs_enable_lora_and_one_rank(tiny_llm_dir: Path, adapters: Callable) -> None:
    llm = LLM(str(tiny_llm_dir), dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValidationError) as err:
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapters("attn-r2")[0])))
    assert err.value.param == "lora_request" and "enable_lora" in str(err.value)
    llm.shutdown()
    for kwargs, param in [(dict(tensor_parallel_size=2), "enable_lora"), (dict(max_loras=0), "max_loras"),
                          (dict(max_lora_rank=-1), "max_lora_rank"),
                          (dict(max_loras=2, max_cpu_loras=1), "max_cpu_loras")]:
        with pytest.raises(ValidationError) as err:
            LLM(str(tiny_llm_dir), enable_lora=True, **kwargs)
        assert err.value.param == param


def test_phi3_adapters_of_the_fused_layers(tiny_model: Callable, tmp_path: Path) -> None:
    """Phi-3's checkpoint has qkv_proj and gate_up_proj: its PEFT adapters name those, and must equal
    transformers + peft's merged model."""
    from tests.lora.utils import make_adapter

    base = tiny_model("phi3-longrope")
    folder, merged = make_adapter(base, tmp_path / "phi3", seed=5, r=8, lora_alpha=16,
                                  target_modules=["qkv_proj", "gate_up_proj", "o_proj", "down_proj"])
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    prompts = [[5, 9, 13, 200, 7], [40, 41, 42]]
    got = _tokens(llm, prompts, LoRARequest("phi3", 1, str(folder)))
    base_tokens = _tokens(llm, prompts)
    llm.shutdown()
    assert got == [greedy_reference(merged, p, GREEDY.max_tokens) for p in prompts] and got != base_tokens


def test_enable_lora_on_a_family_without_lora_layers(tiny_model: Callable) -> None:
    with pytest.raises(ValidationError) as err:
        LLM(str(tiny_model("gpt2")), dtype="float32", enable_lora=True, num_kv_blocks=16)
    assert err.value.param == "enable_lora" and "GPT2LMHeadModel" in str(err.value)


def test_remove_lora(lora_llm: LLM, adapters: Callable) -> None:
    lora = LoRARequest("attn-r2", 9, str(adapters("attn-r2")[0]))
    assert lora_llm.add_lora(lora) and not lora_llm.add_lora(lora) and 9 in lora_llm.list_loras()
    first = _tokens(lora_llm, PROMPTS[:2], lora)
    assert lora_llm.remove_lora(9) and not lora_llm.remove_lora(9) and 9 not in lora_llm.list_loras()
    assert _tokens(lora_llm, PROMPTS[:2], lora) == first  # a request adds it again


def test_speculation_with_adapters_gives_the_merged_models_tokens(tiny_llm_dir: Path, adapters: Callable) -> None:
    """Drafts verified under each request's adapter (mixed in one batch) keep its greedy tokens; the prompts repeat
    themselves, so prompt lookup drafts and some drafts are accepted."""
    folder, merged = adapters("all-r8")
    lora = LoRARequest("all-r8", 1, str(folder))
    llm = LLM(str(tiny_llm_dir), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=128,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 2, "disable_by_batch_size": None})
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False,
                        lora_request=[lora, None] * 3)
    base = LLM(str(tiny_llm_dir), dtype="float32", num_kv_blocks=128)
    for i, (p, out) in enumerate(zip(PROMPTS, outs)):
        want = greedy_reference(merged, p, 24) if i % 2 == 0 else \
            base.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids
        assert out.outputs[0].token_ids == want, i
    assert llm.get_stats().spec_decode_num_accepted_tokens > 0
    llm.shutdown()
