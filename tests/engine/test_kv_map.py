"""The KV pool's picture (core/kv_map.py) against the requests it holds: owners, fill, sharing, and the
paper's accounting of the slots."""
from __future__ import annotations

from pathlib import Path

from pagedllm import LLM, SamplingParams


def test_map_accounts_for_every_slot(tiny_llm_dir: Path) -> None:
    llm = LLM(str(tiny_llm_dir), dtype="float32", num_kv_blocks=64, block_size=16)
    engine = llm.llm_engine
    prompts = [list(range(10, 10 + n)) for n in (5, 21, 40)]
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("pair", {"prompt_token_ids": list(range(100, 140))},
                       SamplingParams(n=2, max_tokens=8, ignore_eos=True, temperature=1.0, seed=1))
    for _ in range(3):
        engine.step()
    state = engine.kv_map()
    a, bs = state["accounting"], state["block_size"]
    kv = engine.engine_core.core.scheduler.kv_cache_manager
    held = {r: len(blocks) for r, blocks in kv.req_to_blocks.items()}
    assert sorted(state["requests"]) == sorted(held) and len(held) == 5  # the pair: two sequences
    assert len(state["owner"]) == len(state["refs"]) == len(state["filled"]) == state["num_blocks"] == 64
    assert state["owner"][0] == -3 and a["usable_blocks"] == 63
    assert a["used_blocks"] + a["free_blocks"] == 63 and a["free"] == a["free_blocks"] * bs
    assert a["token_states"] + a["internal_fragmentation"] + a["reserved"] == a["used_blocks"] * bs
    assert a["used_blocks"] == sum(1 for r in state["refs"][1:] if r > 0) == round(kv.usage() * 63)
    assert a["shared_blocks"] >= 2  # the pair's 40-token prompt: two full blocks shared after the fork
    computed = {r.request_id: r.num_computed_tokens for r in engine.engine_core.core.scheduler.requests.values()}
    shared_slots = sum(state["filled"][b] * (state["refs"][b] - 1) for b in range(64) if state["refs"][b] > 1)
    assert a["token_states"] == sum(computed[r] for r in held) - shared_slots  # shared slots counted once
    for index, req_id in enumerate(state["requests"]):
        first = kv.req_to_blocks[req_id][0].block_id
        assert state["owner"][first] == index or state["refs"][first] > 1
    while engine.has_unfinished_requests():
        engine.step()
    done = engine.kv_map(cells=False)["accounting"]
    assert done["used_blocks"] == done["token_states"] == 0 and done["cached_free"] > 0  # prefixes kept cached
