"""prompt_logprobs of a long prompt score a slice of rows at a time (issue 43, point 5): the engine's peak memory
grows by far less than a whole chunk's full-vocabulary logits."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from pagedllm import LLM, SamplingParams
from tests.utils import save_tiny_model


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def test_top_20_prompt_logprobs_of_a_whole_chunk_keep_the_peak_small(tmp_path: Path, tokenizer: Any) -> None:
    """A 2,048-token chunk's logits over 49,152 tokens are 0.4 GB in float32, and as much again for their
    log-softmax: scored at once they raised the peak RSS by ~1.2 GB (measured 1,247 MiB), 256 rows at a time ~0.16."""
    model = save_tiny_model(tmp_path, "llama-gqa-untied", vocab_size=len(tokenizer), tokenizer=tokenizer,
                            max_position_embeddings=4096)
    llm = LLM(str(model), dtype="float32", num_kv_blocks=256)  # max_num_batched_tokens 2,048: one chunk
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(2048)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=20)
    llm.generate({"prompt_token_ids": prompt[:64]}, params, use_tqdm=False)  # the step's own buffers exist once
    try:  # "5" resets the peak RSS (VmHWM) to the RSS now: the peak of the next request is then read exactly
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:
        pytest.skip(f"cannot reset the peak RSS: {e}")
    rss = status_kib("VmRSS")
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    growth_mib = (status_kib("VmHWM") - rss) / 1024
    scored = out.prompt_logprobs
    assert len(scored) == 2048 and scored[0] is None and all(len(e) >= 20 for e in scored[1:])
    assert growth_mib < 400, growth_mib
    llm.shutdown()
