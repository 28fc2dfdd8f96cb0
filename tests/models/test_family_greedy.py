"""Every model family end to end: greedy tokens over 32 steps equal transformers' on several prompts,
through a KV pool small enough to preempt, a token budget that chunks prompts, and prompts sharing a
prefix (prefix-cache hits) — on the compiled CPU attention backend where it runs and on the torch one."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.base import registered_backends
from tests.utils import TINY_VARIANTS

STEPS = 32


def hf_greedy(path: str, prompt: list[int], steps: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 500, (12,), generator=g).tolist()  # three full blocks of 4 in common
    return [shared + torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 9, 20)] + \
        [torch.randint(3, 500, (7,), generator=g).tolist()]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_greedy_tokens_match_transformers(variant: str, backend: str, tiny_model) -> None:
    if not registered_backends()[backend].is_available():
        pytest.skip(f"the {backend} attention backend does not run here")
    path = str(tiny_model(variant))
    want = [hf_greedy(path, p, STEPS) for p in prompts()]
    # 24 blocks of 4 tokens: the four sequences (up to 64 tokens each) cannot all stay (a sliding window
    # frees blocks as the sequences grow: a smaller pool)
    blocks = 12 if "sliding" in variant else 24
    llm = LLM(path, dtype="float32", attention_backend=backend, block_size=4, num_kv_blocks=blocks,
              max_num_batched_tokens=16, enable_prefix_caching=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()],
                        SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True), use_tqdm=False)
    stats = llm.get_stats()
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == want
    assert stats.num_preemptions > 0 and stats.num_chunked_prefills > 0 and stats.prefix_cache_hits > 0, stats


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_sliding_window_bounds_the_blocks_and_matches_transformers(backend: str, tiny_model) -> None:
    """Mistral with a 10-token window: a 48-token sequence (4.8 windows) in a pool of 7 usable 4-token blocks
    (12 without the window), token for token with transformers, blocks outside the window returned."""
    if not registered_backends()[backend].is_available():
        pytest.skip(f"the {backend} attention backend does not run here")
    path = str(tiny_model("mistral-sliding-window"))
    prompt = torch.randint(3, 500, (8,), generator=torch.Generator().manual_seed(9)).tolist()
    want = hf_greedy(path, prompt, 40)
    llm = LLM(path, dtype="float32", attention_backend=backend, block_size=4, num_kv_blocks=8,
              max_num_batched_tokens=8, enable_prefix_caching=False)
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=40, temperature=0.0,
                                                                          ignore_eos=True))
    kv, most, out = engine.engine_core.core.scheduler.kv_cache_manager, 0, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        assert kv.check_integrity()
        live = [b for blocks in kv.req_to_blocks.values() for b in blocks if b is not kv.block_pool.null_block]
        most = max(most, len(live))
    llm.shutdown()
    assert out.outputs[0].token_ids == want
    assert most <= 6 < 12
