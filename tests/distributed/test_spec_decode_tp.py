"""Speculative decoding at tensor_parallel_size=2: every rank proposes and verifies the same drafts, and the
tokens are those of tp=1 without speculation; a draft model at tp > 1 is refused."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.errors import ValidationError
from tests.distributed.utils import descendants

PROMPTS = ["one two three four five six one two three four five six one two three",
           "The cat sat on the mat. The cat sat on the mat. The cat", "Hello"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_k=20, max_tokens=20, ignore_eos=True, seed=5, n=2)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_tp2_speculation_gives_the_tokens_of_tp1(tp_llm: Callable[..., LLM], tiny_llm_dir: Path) -> None:
    ref = tp_llm(tiny_llm_dir)
    expected = [[c.token_ids for c in o.outputs] for o in ref.generate(PROMPTS, [GREEDY, SEEDED, GREEDY],
                                                                       use_tqdm=False)]
    before = {p.pid for p in descendants()}
    llm = tp_llm(tiny_llm_dir, tensor_parallel_size=2, distributed_executor_backend="mp", speculative_config=NGRAM)
    got = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, [GREEDY, SEEDED, GREEDY], use_tqdm=False)]
    assert got == expected
    stats = llm.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert stats.kv_cache_usage == 0.0
    llm.shutdown()
    left = [p for p in descendants() if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline())]
    assert not left, [(p.pid, p.cmdline()) for p in left]  # (multiprocessing's tracker lives as long as we do)


def test_a_draft_model_at_tp2_is_refused(tiny_llm_dir: Path) -> None:
    with pytest.raises(ValidationError) as e:
        LLM(str(tiny_llm_dir), tensor_parallel_size=2, speculative_config={"model": str(tiny_llm_dir)})
    assert e.value.param == "speculative_config.model"
