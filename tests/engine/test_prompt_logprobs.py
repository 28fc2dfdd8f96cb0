"""prompt_logprobs equal transformers' log-softmax of the same prompt: chunked prefill, after a
prefix-cache hit, and with n > 1 (scored once)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams

PROMPT = [1] + [(7 * i + 3) % 4000 + 10 for i in range(44)]  # 45 tokens: 3 chunks of 16


@pytest.fixture(scope="module")
def reference(tiny_llm_dir: Path) -> torch.Tensor:
    """(len(PROMPT) - 1, vocab) transformers' log-probabilities of the next token at each position."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_llm_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, :-1]
    return logits.log_softmax(-1)


def _check(entries: list, reference: torch.Tensor, top_n: int) -> None:
    assert entries[0] is None and len(entries) == len(PROMPT)
    for pos, entry in enumerate(entries[1:]):
        want = reference[pos]
        token = PROMPT[pos + 1]
        assert abs(entry[token].logprob - want[token].item()) < 1e-4
        lo, hi = (int((want > want[token] + d).sum()) + 1 for d in (1e-4, -1e-4))  # near-ties may swap
        assert lo <= entry[token].rank <= hi
        top = want.topk(top_n).indices.tolist()
        assert set(top) <= set(entry), (pos, top, list(entry))


def test_prompt_logprobs_match_transformers(make_llm: Callable[..., LLM], reference: torch.Tensor) -> None:
    llm = make_llm(max_num_batched_tokens=16, num_kv_blocks=64)  # the prompt runs in 3 chunks
    prompt = {"prompt_token_ids": PROMPT}
    llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)  # its blocks are now cached
    out = llm.generate(prompt, SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    _check(out.prompt_logprobs, reference, 3)  # a cached prefix is scored all the same
    plain = llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0
    pair = llm.generate(prompt, SamplingParams(max_tokens=3, n=2, temperature=1.0, seed=1, prompt_logprobs=0),
                        use_tqdm=False)[0]
    assert len(pair.outputs) == 2
    _check(pair.prompt_logprobs, reference, 0)


def test_prompt_token_id_logprobs_match_transformers(make_llm: Callable[..., LLM], reference: torch.Tensor) -> None:
    """vLLM's prompt_logprob_token_ids / prompt_logprob_start: row i scores its ids as the next token after
    position start + i, equal to transformers' log-softmax there, through 3 prompt chunks and a cached prefix; -1
    pads a row (-inf); the tokens before start + 1 get no prompt_logprobs; n > 1 scores once."""
    import numpy as np

    llm = make_llm(max_num_batched_tokens=16, num_kv_blocks=64)  # 3 chunks: rows 5 .. 43 cross two boundaries
    prompt = {"prompt_token_ids": PROMPT}
    llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)  # its blocks are now cached
    start = 5
    rows = [[PROMPT[p + 1], (p * 13) % 4000] + ([-1] if p % 3 else [p % 4000]) for p in range(start, len(PROMPT) - 1)]
    for n in (1, 2):
        params = SamplingParams(max_tokens=2, n=n, temperature=1.0, seed=3, prompt_logprobs=1,
                                prompt_logprob_token_ids=rows, prompt_logprob_start=start)
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        scores = out.prompt_token_id_logprobs
        assert isinstance(scores, np.ndarray) and scores.dtype == np.float32 and scores.shape == (len(rows), 3)
        for i, row in enumerate(rows):
            for j, token in enumerate(row):
                want = -np.inf if token < 0 else reference[start + i][token].item()
                assert scores[i, j] == pytest.approx(want, abs=1e-4), (i, j)
        assert all(entry is None for entry in out.prompt_logprobs[:start + 1])
        assert abs(out.prompt_logprobs[start + 1][PROMPT[start + 1]].logprob - reference[start][PROMPT[start + 1]]) \
            < 1e-4
    ids_only = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprob_token_ids=rows,
                                                   prompt_logprob_start=start), use_tqdm=False)[0]
    assert ids_only.prompt_logprobs is None and np.array_equal(ids_only.prompt_token_id_logprobs, scores)
    as_array = SamplingParams(max_tokens=1, prompt_logprob_token_ids=np.array(rows), prompt_logprob_start=start)
    assert as_array.prompt_logprob_token_ids == rows  # (vLLM takes a numpy array too)


@pytest.mark.parametrize(("options", "words"), [
    ({"prompt_logprob_token_ids": [[1]] * 44, "prompt_logprob_start": 1}, "scored rows"),  # 45 - 1 - 1 rows
    ({"prompt_logprob_token_ids": [[1]] * 43}, "scored rows"),
    ({"prompt_logprob_token_ids": [[1]] * 300}, "max_model_len - 1"),
    ({"prompt_logprob_token_ids": [[1] * 21] * 44}, "max allowed"),
    ({"prompt_logprob_token_ids": [[10**6]] * 44}, "out-of-vocab"),
    ({"prompt_logprob_token_ids": [[-2]] * 44}, "token ids"),
    ({"prompt_logprob_token_ids": [[]] * 44}, "non-empty"),
    ({"prompt_logprob_token_ids": []}, "non-empty"),
    ({"prompt_logprob_start": 2}, "requires prompt_logprobs"),
    ({"prompt_logprobs": 0, "prompt_logprob_start": 44}, "at least one prompt row"),  # (rows 0 .. 43)
    ({"prompt_logprobs": 0, "prompt_logprob_start": -1}, ">= 0"),
])
def test_prompt_token_id_logprobs_are_checked(make_llm: Callable[..., LLM], options: dict, words: str) -> None:
    """Each bad shape, bound or start is a ValidationError naming the field, in vLLM's words (max_logprobs 20,
    max_model_len 256); the engine serves on."""
    from pagedllm.errors import ValidationError

    llm = make_llm(num_kv_blocks=64, max_model_len=256)
    with pytest.raises(ValidationError, match=words) as err:
        llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, **options), use_tqdm=False)
    assert err.value.param in options
    assert llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1), use_tqdm=False)[0].outputs
