"""logit_bias, allowed_token_ids and bad_words change what is sampled (greedy and random rows alike)."""
from __future__ import annotations

from pagedllm import LLM, SamplingParams

LLM_OPTIONS = dict(num_kv_blocks=128)
PROMPTS = ["The capital of France is", "Once upon a time", "def f(x):"]


def _tokens(llm: LLM, **params) -> list[list[int]]:
    sp = SamplingParams(max_tokens=12, ignore_eos=True, **{"temperature": 0.0, **params})
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


def test_logit_bias_forces_and_bans(llm: LLM) -> None:
    plain = _tokens(llm)
    forced = 1234
    for temperature in (0.0, 1.0):
        assert all(set(t) == {forced} for t in _tokens(llm, logit_bias={forced: 100}, temperature=temperature, seed=1))
    first = plain[0][0]
    banned = _tokens(llm, logit_bias={str(first): -100})  # OpenAI's JSON keys are strings
    assert banned[0][0] != first and all(first not in t for t in banned)


def test_allowed_token_ids_restrict_every_sample(llm: LLM) -> None:
    allowed = [17, 400, 9000]
    for temperature in (0.0, 1.0):
        got = _tokens(llm, allowed_token_ids=allowed, temperature=temperature, seed=3)
        assert all(set(t) <= set(allowed) for t in got)


def test_bad_words_never_appear(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    plain = _tokens(llm)
    word = tokenizer.decode([plain[1][0]]).strip() or "the"
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, bad_words=[word, "of the"])
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    bad_ids = llm.llm_engine.processor.bad_words_token_ids(params.bad_words)  # as the engine tokenizes them
    assert [plain[1][0]] in bad_ids
    for tokens in out:
        for bad in bad_ids:
            n = len(bad)
            assert all(tokens[i:i + n] != bad for i in range(len(tokens) - n + 1)), (bad, tokens)
    assert out != plain
