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
