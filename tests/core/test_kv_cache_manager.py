"""KVCacheManager: exact block ids as requests grow, all-or-nothing allocation, free order."""
import pytest

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from tests.core.utils import make_request


def grow(manager: KVCacheManager, request: Request, num_new_tokens: int) -> list[int] | None:
    """Allocate slots for ``num_new_tokens`` and mark them computed; the new block ids, or None."""
    blocks = manager.allocate_slots(request, num_new_tokens)
    if blocks is None:
        return None
    request.num_computed_tokens += num_new_tokens
    return [b.block_id for b in blocks]


def test_blocks_are_taken_only_when_a_block_fills() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request("a", 5)
    assert grow(manager, req, 5) == [1, 2]
    assert grow(manager, req, 3) == []  # 8 tokens: still 2 blocks
    assert grow(manager, req, 1) == [3]  # 9th token opens block 3
    assert manager.get_block_ids("a") == [1, 2, 3]
    assert manager.num_free_blocks == 4
    assert manager.check_integrity()


def test_two_requests_interleave_block_ids() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    a, b = make_request("a", 4), make_request("b", 6)
    assert grow(manager, a, 4) == [1]
    assert grow(manager, b, 6) == [2, 3]
    assert grow(manager, a, 1) == [4]
    assert manager.get_block_ids("a") == [1, 4]
    assert manager.get_block_ids("b") == [2, 3]
    assert manager.check_integrity()


def test_allocation_fails_whole_and_changes_nothing() -> None:
    manager = KVCacheManager(num_blocks=5, block_size=4)  # 4 usable blocks
    a, b = make_request("a", 8), make_request("b", 12)
    assert grow(manager, a, 8) == [1, 2]
    assert manager.allocate_slots(b, 12) is None  # needs 3, only 2 free
    assert manager.get_block_ids("b") == [] and "b" not in manager.req_to_blocks
    assert manager.block_pool.free_queue.block_ids() == [3, 4]
    assert manager.allocate_slots(a, 9) is None  # 17 tokens need 5 blocks, a holds 2 and 2 are free
    assert manager.get_block_ids("a") == [1, 2]
    assert manager.block_pool.free_queue.block_ids() == [3, 4]
    assert manager.check_integrity()
    assert grow(manager, a, 8) == [3, 4]  # exactly the free blocks: fits
    assert manager.num_free_blocks == 0 and manager.usage() == 1.0


def test_free_returns_the_tail_first_to_the_queue_end() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    a, b = make_request("a", 12), make_request("b", 4)
    assert grow(manager, a, 12) == [1, 2, 3]
    assert grow(manager, b, 4) == [4]
    manager.free(a)
    assert manager.block_pool.free_queue.block_ids() == [5, 6, 7, 3, 2, 1]
    assert manager.get_block_ids("a") == []
    manager.free(b)
    assert manager.block_pool.free_queue.block_ids() == [5, 6, 7, 3, 2, 1, 4]
    assert manager.check_integrity()
    # The next request reuses the least recently freed blocks first.
    c = make_request("c", 16)
    assert grow(manager, c, 16) == [5, 6, 7, 3]


def test_check_integrity_catches_a_corrupted_ref_cnt() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=4)
    req = make_request("a", 8)
    grow(manager, req, 8)
    assert manager.check_integrity()
    manager.block_pool.blocks[2].ref_cnt = 2  # a reference nobody holds
    with pytest.raises(AssertionError, match="block 2"):
        manager.check_integrity()
    manager.block_pool.blocks[2].ref_cnt = 1
    assert manager.check_integrity()
    manager.block_pool.blocks[4].ref_cnt = 1  # held by nobody, yet still in the free queue
    with pytest.raises(AssertionError, match="block 4"):
        manager.check_integrity()


def test_check_integrity_catches_a_handed_out_null_block() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    manager.req_to_blocks["a"] = [manager.block_pool.null_block]
    with pytest.raises(AssertionError, match="null block"):
        manager.check_integrity()


def test_a_table_changed_in_place_is_reported_once() -> None:
    """Started from nothing, copied on write, swapped in: the workers need the whole table, once."""
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False, num_host_blocks=4)
    a, b = make_request("a", 12), make_request("b", 12)
    grow(manager, a, 6)
    assert manager.take_replaced_table("a") and not manager.take_replaced_table("a")
    assert grow(manager, a, 3) == [3] and not manager.take_replaced_table("a")  # only appended
    manager.fork(a, b)
    b.num_computed_tokens = a.num_computed_tokens
    grow(manager, b, 1)  # b writes into the last block it shares with a: copy on write
    assert manager.take_replaced_table("b") and not manager.take_replaced_table("a")
    assert manager.swap_out(a) is not None and manager.is_swapped("a") and not manager.is_swapped("b")
    assert manager.swap_in(a, 1) is not None and not manager.is_swapped("a")
    assert manager.take_replaced_table("a")
    manager.free(a)
    manager.free(b)
    assert not manager.take_replaced_table("a") and not manager.take_replaced_table("b")
    assert manager.check_integrity()


def test_sliding_window_swap_keeps_the_null_placeholders() -> None:
    """A request with blocks freed outside its window swaps out only its live blocks and comes back with
    the null block in the same table positions."""
    manager = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False, num_host_blocks=4, sliding_window=5)
    request = Request("a", list(range(1, 13)), SamplingParams(max_tokens=20), 0, 20)
    manager.allocate_slots(request, 12)  # 3 blocks, positions 0..11
    request.num_computed_tokens = 12
    request.append_output_token(7)
    manager.allocate_slots(request, 1)  # the next query (position 12) sees 8..12: blocks 0 and 1 go back
    null = manager.block_pool.null_block
    table = manager.req_to_blocks["a"]
    assert table[0] is null and table[1] is null and table[2] is not null and manager.take_replaced_table("a")
    live = [b.block_id for b in table if b is not null]
    out = manager.swap_out(request)
    assert [d for d, _ in out] == live and manager.req_to_host_blocks["a"][:2] == [None, None]
    assert manager.check_integrity() and manager.block_pool.num_free_blocks == 9
    back = manager.swap_in(request, 1)
    assert len(back) == len(live) and manager.req_to_blocks["a"][:2] == [null, null]
    assert manager.check_integrity() and len(manager.host_free) == 4
    manager.free(request)
    assert manager.check_integrity() and manager.block_pool.num_free_blocks == 9
