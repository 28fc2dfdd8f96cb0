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
    factory = llm.llm_engine.engine_core.core.request_factory
    bad_ids = factory.bad_words_token_ids(params.bad_words)  # as the engine tokenizes them
    assert [plain[1][0]] in bad_ids
    for tokens in out:
        for bad in bad_ids:
            n = len(bad)
            assert all(tokens[i:i + n] != bad for i in range(len(tokens) - n + 1)), (bad, tokens)
    assert out != plain


def test_thinking_token_budget_forces_the_end_marker(llm: LLM) -> None:
    """Offline, with the markers given: N tokens after the prompt's open start marker, the end marker's tokens
    follow one per step (a random row too), then the model goes on; n > 1 samples each keep the budget."""
    start, end = [44, 17400, 46], [9617, 17400, 46]  # "<think>", "</think>" in the default tokenizer
    prompt = {"prompt_token_ids": [1, 520, 9531, 198, *start, 198]}
    for temperature, n in ((0.0, 1), (1.0, 2)):
        params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=temperature, seed=5, n=n,
                                thinking_token_budget=4, reasoning_start_token_ids=start, reasoning_end_token_ids=end)
        for out in llm.generate([prompt], params, use_tqdm=False)[0].outputs:
            assert out.token_ids[3:6] == end, out.token_ids  # the prompt's newline is the first thinking token
            assert all(out.token_ids[i:i + 3] != end for i in range(3))


def test_chat_continues_the_final_message(llm: LLM) -> None:
    """LLM.chat's continue_final_message: the prompt ends inside the assistant's prefill (vLLM's offline option)."""
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, my name is"}]
    out = llm.chat(conversation, SamplingParams(max_tokens=2), use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True, chat_template_kwargs={"unused": 1})
    assert out[0].prompt.endswith("Hello, my name is")


def test_logprob_token_ids_report_those_tokens_with_their_ranks(llm: LLM) -> None:
    """Offline logprob_token_ids: each position lists those tokens and the sampled one, with the values and ranks
    the top-20 gives the same tokens (greedy; a row without them in the same batch keeps its top-N)."""
    top = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3, temperature=0.0, logprobs=20), use_tqdm=False)
    first = top[0].outputs[0].logprobs[0]
    asked = [t for t, lp in first.items() if lp.rank in (2, 5, 9)] + [3]
    both = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=3, temperature=0.0, logprob_token_ids=asked),
                                      SamplingParams(max_tokens=3, temperature=0.0, logprobs=2)], use_tqdm=False)
    listed = both[0].outputs[0]
    assert listed.token_ids == top[0].outputs[0].token_ids
    for token, mine, theirs in zip(listed.token_ids, listed.logprobs, top[0].outputs[0].logprobs):
        assert set(mine) == set(asked) | {token}
        for t, lp in mine.items():
            if t in theirs:
                assert abs(lp.logprob - theirs[t].logprob) < 1e-4 and lp.rank == theirs[t].rank
    assert all(len(entry) in (2, 3) for entry in both[1].outputs[0].logprobs)  # its own top-2 (+ the token)
