"""engine/dp_router.py: which data-parallel replica takes a request, from the caches the replicas report."""
from __future__ import annotations

import pytest

from pagedllm.core.kv_cache_manager import ROUTING_KEY_MASK, KVCacheManager, prompt_routing_keys
from pagedllm.engine.dp_router import Router
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

BS = 4


def _prompt(*blocks: int) -> list[int]:
    """A prompt of whole blocks, block i filled with token ``blocks[i]``."""
    return [t for b in blocks for t in [b] * BS]


def test_routing_keys_are_the_cores_block_hashes() -> None:
    """The front's keys are the low 64 bits of the hashes the core's KV manager gives the same tokens (with a
    salt: the cache salt and the adapter)."""
    tokens = list(range(1, 43))
    request = Request("r", tokens, SamplingParams(max_tokens=1), None, 1, cache_salt="s")
    manager = KVCacheManager(16, BS)
    want = [h & ROUTING_KEY_MASK for h in manager.block_hashes(request)]
    assert prompt_routing_keys(tokens, BS, "s") == want and len(want) == 42 // BS
    assert prompt_routing_keys(tokens, BS) != want  # another salt, other keys


def test_prefix_routing_follows_the_longest_cached_prefix() -> None:
    router = Router(3, BS, "prefix")
    assert router.choose(_prompt(1, 2, 3)) == (0, 0)  # nothing cached anywhere: least loaded, turn by turn
    router.report(1, prompt_routing_keys(_prompt(1, 2), BS), [])
    router.report(2, prompt_routing_keys(_prompt(1, 2, 3), BS), [])
    assert router.choose(_prompt(1, 2, 3, 4)) == (2, 3)
    assert router.choose(_prompt(1, 2, 9)) in ((1, 2), (2, 2))
    assert router.choose(_prompt(7, 2, 3))[1] == 0  # a different first block: no hit (chained hashes)
    router.report(2, [], prompt_routing_keys(_prompt(1, 2, 3), BS)[2:])  # replica 2 evicted the third block
    router.load[1] = 1  # equal hits: the less loaded wins
    assert router.choose(_prompt(1, 2, 3)) == (2, 2)


def test_the_imbalance_bound_overrides_a_hit() -> None:
    router = Router(2, BS, "prefix", max_imbalance=2)
    router.report(0, prompt_routing_keys(_prompt(5, 6), BS), [])
    router.load = [2, 0]
    assert router.choose(_prompt(5, 6)) == (0, 2)  # within the bound
    router.load = [3, 0]
    assert router.choose(_prompt(5, 6)) == (1, 0)  # 3 beyond the least loaded: the hit is not worth the queue


def test_least_loaded_and_round_robin_ignore_caches() -> None:
    router = Router(3, BS, "least-loaded")
    router.report(0, prompt_routing_keys(_prompt(1), BS), [])
    router.load = [1, 0, 0]
    picks = []
    for _ in range(4):
        pick, _ = router.choose(_prompt(1))
        router.load[pick] += 1
        picks.append(pick)
    assert picks == [1, 2, 0, 1]
    rr = Router(3, BS, "round-robin")
    rr.load = [9, 0, 0]
    assert [rr.choose(_prompt(1))[0] for _ in range(4)] == [0, 1, 2, 0]


def test_lost_replicas_get_nothing_and_come_back_empty() -> None:
    router = Router(2, BS, "prefix")
    router.report(0, prompt_routing_keys(_prompt(1, 2), BS), [])
    router.load = [3, 0]
    router.set_alive(0, False)
    assert router.choose(_prompt(1, 2)) == (1, 0)
    router.set_alive(1, False)
    with pytest.raises(LookupError, match="no data-parallel replica"):
        router.choose(_prompt(1))
    router.set_alive(0, True)
    assert router.cached[0] == set() and router.load[0] == 0
    assert router.choose(_prompt(1, 2)) == (0, 0)
