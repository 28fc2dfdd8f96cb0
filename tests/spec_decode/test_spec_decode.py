"""Speculative decoding end to end on tiny random models: the tokens are those of decoding without it.

Greedy output is identical for every method (a draft model equal to the target is accepted in full, a perturbed
one in part), under a tight pool with preemption (recompute and swap), chunked prefill, prefix-cache hits,
n = 3, structured outputs and stop strings; seeded sampled requests give the same tokens and logprobs; the
first tokens' distribution without a seed matches decoding without speculation (chi-square); every block is
free afterwards.
"""
from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.errors import ValidationError
from pagedllm.sampling_params import StructuredOutputsParams

PROMPTS = ["one two three four five six one two three four five six one two three",
           "The cat sat on the mat. The cat sat on the mat. The cat",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
           "Hello",
           "A B C D E F G A B C D E F G A B C D E F G A B C"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
# every batch size speculates (the default stops above 4 sequences; these tests run 5 and more)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": None}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 6, "disable_by_batch_size": None}


@pytest.fixture(scope="module")
def noisy_draft_dir(tiny_llm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with one layer's MLP perturbed: it agrees with the target on some tokens, not all."""
    path = tmp_path_factory.mktemp("noisy-draft")
    for f in tiny_llm_dir.iterdir():
        if f.is_file():
            shutil.copy(f, path / f.name)
    weights = load_file(str(path / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    for name in ("model.layers.1.mlp.down_proj.weight", "model.layers.1.self_attn.o_proj.weight"):
        w = weights[name]
        weights[name] = w + 1.0 * w.std() * torch.randn(w.shape, generator=generator)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _core(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.core


def _assert_pool_clean(llm: LLM) -> None:
    kv = _core(llm).scheduler.kv_cache_manager
    assert kv.check_integrity()
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks, "blocks left held"
    assert not kv.req_to_host_blocks and len(kv.host_free) == kv.num_host_blocks


def _tokens(llm: LLM, prompts: list[str], params: SamplingParams | list[SamplingParams]) -> list[list[list[int]]]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    _assert_pool_clean(llm)
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def reference(make_llm: Callable[..., LLM]) -> LLM:
    return make_llm()


@pytest.fixture(scope="module")
def reference_greedy(reference: LLM) -> list[list[list[int]]]:
    return _tokens(reference, PROMPTS, GREEDY)


def _spec(llm: LLM) -> tuple[int, int, int]:
    stats = llm.get_stats()
    return stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft=target", "draft=perturbed"])
def test_greedy_output_is_unchanged(make_llm: Callable[..., LLM], reference_greedy: list, tiny_llm_dir: Path,
                                    noisy_draft_dir: Path, method: str) -> None:
    config = {"ngram": NGRAM, "suffix": SUFFIX,
              "draft=target": {"model": str(tiny_llm_dir), "num_speculative_tokens": 3, "disable_by_batch_size": None},
              "draft=perturbed": {"model": str(noisy_draft_dir), "num_speculative_tokens": 3,
                                  "disable_by_batch_size": None}}[method]
    llm = make_llm(speculative_config=config)
    assert _tokens(llm, PROMPTS, GREEDY) == reference_greedy
    drafts, draft_tokens, accepted = _spec(llm)
    assert drafts > 0 and draft_tokens >= drafts
    if method == "draft=target":
        assert accepted == draft_tokens  # the target's own argmax is always accepted
    else:
        assert 0 < accepted < draft_tokens, (accepted, draft_tokens)
    per_pos = llm.get_stats().spec_decode_num_accepted_tokens_per_pos
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)


@pytest.mark.parametrize("options", [
    dict(num_kv_blocks=12, max_num_seqs=8),  # 5 x ~60 tokens need ~20 blocks: recompute preemptions
    dict(num_kv_blocks=12, max_num_seqs=8, preemption_mode="swap", swap_space=0.01),
    dict(max_num_batched_tokens=8),  # prompts in chunks; drafts share the small budget
], ids=["recompute", "swap", "chunked"])
@pytest.mark.parametrize("draft", [False, True], ids=["ngram", "draft-model"])
def test_greedy_unchanged_under_preemption_and_chunking(make_llm: Callable[..., LLM], reference_greedy: list,
                                                        noisy_draft_dir: Path, options: dict, draft: bool) -> None:
    config = {"model": str(noisy_draft_dir), "num_speculative_tokens": 3, "disable_by_batch_size": None} if draft \
        else NGRAM
    llm = make_llm(speculative_config=config, **options)
    assert _tokens(llm, PROMPTS, GREEDY) == reference_greedy
    stats = llm.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    if "num_kv_blocks" in options:
        assert stats.num_preemptions > 0
    else:
        assert stats.num_chunked_prefills > 0


def test_prefix_hits_n3_and_seeded_samples(make_llm: Callable[..., LLM], reference: LLM) -> None:
    shared = "A long shared system prefix that fills more than one block of sixteen tokens for sure. "
    prompts = [shared + p for p in PROMPTS]
    sampled = [SamplingParams(temperature=0.9, top_k=40, top_p=0.9, presence_penalty=0.5, logit_bias={11: 2.0},
                              max_tokens=24, ignore_eos=True, n=3, seed=i, logprobs=2) for i in range(len(prompts))]
    ref_greedy = _tokens(reference, prompts, GREEDY)
    ref_out = reference.generate(prompts, sampled, use_tqdm=False)
    llm = make_llm(speculative_config=NGRAM)
    assert _tokens(llm, prompts, GREEDY) == ref_greedy
    out = llm.generate(prompts, sampled, use_tqdm=False)
    _assert_pool_clean(llm)
    assert llm.get_stats().prefix_cache_hits > 0
    assert _spec(llm)[2] > 0
    for a, b in zip(ref_out, out):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs):  # the same logprobs, one entry per token
            assert len(cb.logprobs) == len(cb.token_ids)
            assert [sorted(e) for e in ca.logprobs] == [sorted(e) for e in cb.logprobs]
            assert cb.cumulative_logprob == pytest.approx(ca.cumulative_logprob, abs=1e-3)


def test_structured_outputs_and_stop_strings(make_llm: Callable[..., LLM], reference: LLM) -> None:
    free = reference.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = free[len(free) // 3:len(free) // 3 + 4]  # a string the output reaches partway
    assert stop.strip()
    params = [SamplingParams(temperature=0.0, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(regex=r"(one two three ){2,6}four")),
              SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json={
                  "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})),
              SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, stop=[stop]),
              SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(choice=["one two three four five six"] * 1))]
    prompts = [PROMPTS[0], "JSON: ", PROMPTS[1], PROMPTS[0]]
    ref = reference.generate(prompts, params, use_tqdm=False)
    llm = make_llm(speculative_config=NGRAM)
    got = llm.generate(prompts, params, use_tqdm=False)
    _assert_pool_clean(llm)
    for a, b in zip(ref, got):
        assert (a.outputs[0].token_ids, a.outputs[0].text) == (b.outputs[0].token_ids, b.outputs[0].text)
    assert got[0].outputs[0].text.endswith("four")
    json.loads(got[1].outputs[0].text)
    assert got[2].outputs[0].finish_reason == "stop" and got[2].outputs[0].text == free[:free.index(stop)]
    assert _spec(llm)[2] > 0


def test_drafts_that_cross_the_reasoning_end(make_llm: Callable[..., LLM], reference: LLM, tokenizer: Any) -> None:
    """grammar_after_reasoning: the prompt shows the end marker followed by a reply, so once the thinking budget
    forces the marker's first token the n-gram drafts run through the marker into the content; the rows after it
    are masked by the grammar, those before it not, and the tokens are those of decoding without drafts."""
    think, end = [44, 17400, 46], [9617, 17400, 46]  # "<think>", "</think>" in the default tokenizer
    shown = [*end, *tokenizer.encode('yes {"a": 1}', add_special_tokens=False), 198]
    prompt = {"prompt_token_ids": [1, 520, 9531, 198, *shown, *shown, *think, 198]}
    params = [SamplingParams(temperature=0.0, max_tokens=40, grammar_after_reasoning=True, thinking_token_budget=3,
                             reasoning_start_token_ids=think, reasoning_end_token_ids=end, structured_outputs=spec)
              for spec in (StructuredOutputsParams(choice=["yes", "no"]), StructuredOutputsParams(json={
                  "type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}))]
    ref = reference.generate([prompt] * 2, params, use_tqdm=False)
    llm = make_llm(speculative_config=NGRAM)
    got = llm.generate([prompt] * 2, params, use_tqdm=False)
    _assert_pool_clean(llm)
    for a, b in zip(ref, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        ids = list(b.outputs[0].token_ids)
        assert ids[2:5] == end, ids
        content = tokenizer.decode(ids[5:], skip_special_tokens=True)
        assert content in ("yes", "no") or json.loads(content)["a"] in (1, 2), content
    assert _spec(llm)[2] > 0


def test_first_tokens_keep_the_distribution(tiny_model: Callable[[str], Path], noisy_draft_dir: Path) -> None:
    """Unseeded sampling: the joint distribution of the first three tokens, with drafts verified for the second
    and third (a draft model that agrees in part), matches decoding without speculation."""
    from scipy.stats import chi2_contingency

    model = tiny_model("llama-gqa-untied")
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10]] * 1500
    counts = []
    for config in (None, {"model": str(model), "num_speculative_tokens": 2, "disable_by_batch_size": None}):
        llm = LLM(str(model), dtype="float32", seed=1 if config else 2, speculative_config=config)
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        counts.append(Counter(tuple(o.outputs[0].token_ids) for o in out))
        if config:
            assert _spec(llm)[1] > 1000  # the second and third tokens went through verification
    cells = sorted(set(counts[0]) | set(counts[1]))
    table = [[c.get(cell, 0) for cell in cells] for c in counts]
    table = [[a, b] for a, b in zip(*table) if a + b >= 10]  # sparse cells say nothing
    _, p_value, _, _ = chi2_contingency(list(zip(*table)))
    assert p_value > 1e-3, (p_value, table)


def test_a_request_can_opt_out(make_llm: Callable[..., LLM], reference_greedy: list) -> None:
    llm = make_llm(speculative_config=NGRAM)
    off = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, speculate=False)
    assert _tokens(llm, PROMPTS, off) == reference_greedy
    assert _spec(llm) == (0, 0, 0)


def test_speculation_steps_back_for_a_large_batch(make_llm: Callable[..., LLM], reference_greedy: list) -> None:
    """Sequences of different lengths: the batch shrinks as they end, and a step speculates only once at most
    disable_by_batch_size sequences run."""
    params = [SamplingParams(temperature=0.0, max_tokens=8 * (i + 2), ignore_eos=True) for i in range(len(PROMPTS))]
    expected = [[tokens[0][:p.max_tokens]] for tokens, p in zip(reference_greedy, params)]
    drafts = []
    for limit in (None, 3, 1):
        llm = make_llm(speculative_config={**NGRAM, "disable_by_batch_size": limit})
        assert _tokens(llm, PROMPTS, params) == expected
        drafts.append(_spec(llm)[0])
    assert drafts[0] > drafts[1] > drafts[2] > 0, drafts


@pytest.mark.parametrize("config, param", [
    ({"method": "eagle"}, "speculative_config.method"),
    ({"method": "ngram", "lookahead": 3}, "speculative_config.lookahead"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 999}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_min"),
    ({"method": "draft_model"}, "speculative_config.model"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, "speculative_config.suffix_decoding_min_token_prob"),
    ("{not json", "speculative_config"),
])
def test_bad_configs_are_refused_naming_the_key(make_llm: Callable[..., LLM], config: Any, param: str) -> None:
    with pytest.raises(ValidationError) as e:
        make_llm(speculative_config=config)
    assert e.value.param == param


def test_a_draft_of_another_vocabulary_is_refused(make_llm: Callable[..., LLM], tiny_model: Callable[[str], Path]
                                                  ) -> None:
    with pytest.raises(ValidationError, match="vocabulary") as e:
        make_llm(speculative_config={"model": str(tiny_model("llama-gqa-untied"))})
    assert e.value.param == "speculative_config.model"
