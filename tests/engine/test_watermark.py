"""watermark_config (vLLM's --watermark-config {"algorithm": "gumbel", "key": K}): a sampled token is the argmax of
the processed logits plus keyed Gumbel noise of the last generated tokens, so the same key writes the same tokens,
each one exactly the algorithm's; greedy rows and opted-out requests sample as usual; bad configs are refused by
name."""
from __future__ import annotations

import random
import types
from collections.abc import Callable

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import WatermarkConfig
from pagedllm.errors import ValidationError
from pagedllm.worker.watermark import GumbelWatermark, gumbel_noise, philox4x32

KEY = 42
PROMPTS = ["The capital of France is", "Once upon a time"]


@pytest.fixture(scope="module")
def marked(make_llm: Callable[..., LLM]) -> LLM:
    return make_llm(num_kv_blocks=128, watermark_config={"algorithm": "gumbel", "key": KEY,
                                                         "deduplicate_contexts": "none"})


def _run(llm: LLM, **params) -> list:
    sp = SamplingParams(max_tokens=12, ignore_eos=True, **{"temperature": 1.0, **params})
    return [o.outputs[0] for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


def test_philox_known_answers() -> None:
    """Philox4x32-10 against Random123's known-answer vectors."""
    def words(*values: int) -> tuple[torch.Tensor, ...]:
        return tuple(torch.tensor([v], dtype=torch.int64) for v in values)

    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, expected in cases:
        assert tuple(int(w) for w in philox4x32(words(*counter), key)) == expected


def test_each_token_is_the_keyed_gumbel_argmax(marked: LLM) -> None:
    """With top_k=20 the processed logits are the raw top 20 (temperature 1): logprobs=20 reports exactly them,
    so each token must be argmax(logprob + noise(key, last 4 generated tokens)) over them."""
    for out in _run(marked, top_k=20, logprobs=20):
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            context = ([-1] * 4 + list(out.token_ids[:i]))[-4:]
            noise = gumbel_noise(KEY, context, max(entry) + 1)  # (a token's noise does not depend on the length)
            expected = max(entry, key=lambda t: entry[t].logprob + float(noise[t]))
            assert token == expected, (i, context)


def test_same_key_same_tokens(marked: LLM, make_llm: Callable[..., LLM]) -> None:
    first, again = _run(marked), _run(marked)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]  # no seed: the key decides
    other = make_llm(num_kv_blocks=128, watermark_config='{"algorithm": "gumbel", "key": 43}')
    assert [o.token_ids for o in _run(other)] != [o.token_ids for o in first]
    free = [[o.token_ids for o in _run(marked, watermarking=False)] for _ in range(2)]
    assert free[0] != free[1]  # opted out: ordinary random draws
    greedy = _run(marked, temperature=0.0, logprobs=1)
    for out in greedy:  # greedy rows are never watermarked: the most likely token each time
        assert all(t == max(e, key=lambda k: e[k].logprob) for t, e in zip(out.token_ids, out.logprobs))


def test_repeated_context_is_not_watermarked() -> None:
    mark = GumbelWatermark(WatermarkConfig(key=KEY, context_width=2))

    def state(prompt: list[int], generated: list[int], watermarking: bool = True) -> types.SimpleNamespace:
        return types.SimpleNamespace(token_ids=prompt + generated, num_prompt_tokens=len(prompt),
                                     output_token_ids=generated, watermark_seen=None,
                                     sampling_params=types.SimpleNamespace(watermarking=watermarking))
    fresh, looped = state([7, 8], [1, 2, 3]), state([7, 8], [1, 2, 5, 1, 2])
    assert mark.context(fresh) == [2, 3] and not mark.repeated(fresh, [2, 3])
    assert mark.repeated(looped, [1, 2])  # [1, 2] preceded the 5 already
    noise = mark.noise([fresh, looped, state([7], [4], watermarking=False), fresh], [False, False, False, True],
                       16, torch.device("cpu"))
    assert list(noise) == [0] and torch.equal(noise[0], gumbel_noise(KEY, [2, 3], 16))
    every = GumbelWatermark(WatermarkConfig(key=KEY, context_width=2, deduplicate_contexts="all"))
    assert every.repeated(state([1, 2, 9], [1, 2]), [1, 2])  # found in the prompt
    assert every.repeated(state([5], [6]), [-1, 6])  # the first context_width tokens: unwatermarked


@pytest.mark.parametrize("scope", ["single_turn", "all"])
@pytest.mark.parametrize("max_history", [None, 5])
def test_counted_contexts_agree_with_a_search_of_the_whole_history(scope: str, max_history: int | None) -> None:
    """The incremental count (a step's tokens only) answers as searching the whole history every step would,
    also when the history is rewritten under it (a shorter one, another token)."""
    width = 2
    mark = GumbelWatermark(WatermarkConfig(key=KEY, context_width=width, deduplicate_contexts=scope,
                                           deduplicate_contexts_max_history=max_history))
    rng = random.Random(0)
    prompt = [rng.randrange(4) for _ in range(6)]
    state = types.SimpleNamespace(token_ids=list(prompt), num_prompt_tokens=len(prompt), watermark_seen=None)
    checked = 0
    for step in range(200):
        if step in (80, 140):  # rewritten: cut back, then another token where the last one was
            del state.token_ids[-7:]
            state.token_ids[-1] = (state.token_ids[-1] + 1) % 4
        history = state.token_ids if scope == "all" else state.token_ids[len(prompt):]
        padded = [-1] * width + history
        context = padded[-width:]
        first = 0 if max_history is None else max(0, len(history) - max_history)
        searched = any(padded[i:i + width] == context for i in range(first, len(history)))
        generated = len(state.token_ids) - len(prompt)
        expected = True if scope == "all" and generated < width else searched
        assert mark.repeated(state, context) == expected, step
        checked += expected
        state.token_ids.append(rng.randrange(4))
    assert 0 < checked < 200  # both answers were seen


@pytest.mark.parametrize("config, param", [
    ({"algorithm": "kgw", "key": 1}, "watermark_config.algorithm"),
    ({"algorithm": "dual_key_gumbel", "key": 1}, "watermark_config.algorithm"),
    ({"algorithm": "gumbel"}, "watermark_config.key"),
    ({"key": -1}, "watermark_config.key"),
    ({"key": 1, "alpha": 0.2}, "watermark_config.alpha"),
    ({"key": 1, "context_width": 0}, "watermark_config.context_width"),
    ({"key": 1, "deduplicate_contexts": "some"}, "watermark_config.deduplicate_contexts"),
    ("{not json", "watermark_config"),
])
def test_bad_configs_are_refused_by_name(config: object, param: str) -> None:
    with pytest.raises(ValidationError) as e:
        WatermarkConfig.from_user(config)
    assert e.value.param == param


def test_not_with_speculation(make_llm: Callable[..., LLM]) -> None:
    with pytest.raises(ValidationError) as e:
        make_llm(watermark_config={"key": 1}, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert e.value.param == "watermark_config"
