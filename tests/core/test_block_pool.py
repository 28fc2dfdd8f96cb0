"""BlockPool: the null block, the LRU free queue's exact order, and reference counts."""
import pytest

from pagedllm.core.block_pool import BlockPool


def test_null_block_is_never_free_and_queue_starts_in_order() -> None:
    pool = BlockPool(6)
    assert pool.num_blocks == 6 and pool.num_usable_blocks == 5
    assert pool.null_block is pool.blocks[0]
    assert pool.free_queue.block_ids() == [1, 2, 3, 4, 5]
    assert pool.null_block not in pool.free_queue
    assert pool.usage() == 0.0


def test_get_new_blocks_takes_from_the_front_with_ref_cnt_one() -> None:
    pool = BlockPool(6)
    first = pool.get_new_blocks(2)
    assert [b.block_id for b in first] == [1, 2]
    assert [b.ref_cnt for b in first] == [1, 1]
    assert pool.free_queue.block_ids() == [3, 4, 5]
    second = pool.get_new_blocks(3)
    assert [b.block_id for b in second] == [3, 4, 5]
    assert pool.num_free_blocks == 0 and pool.usage() == 1.0
    assert all(b.block_id != 0 for b in first + second)


def test_freed_blocks_go_to_the_back_in_lru_order() -> None:
    pool = BlockPool(6)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([b])
    pool.free_blocks([c, a])
    assert pool.free_queue.block_ids() == [4, 5, 2, 3, 1]
    # The least recently freed block is handed out first.
    assert [blk.block_id for blk in pool.get_new_blocks(3)] == [4, 5, 2]
    assert pool.free_queue.block_ids() == [3, 1]


def test_shared_block_is_free_only_after_the_last_reference() -> None:
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt += 1  # a second holder, as a shared prefix block would have
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and block not in pool.free_queue
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.free_queue.block_ids() == [2, 3, 1]


def test_new_block_forgets_its_hash() -> None:
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    block.block_hash = 1234
    pool.free_blocks([block])
    pool.get_new_blocks(1)  # block 2
    (again,) = pool.get_new_blocks(1)
    assert again is block and again.block_hash is None


def test_freeing_more_often_than_taken_is_an_assertion_error() -> None:
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="freed more often than taken"):
        pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.free_queue.block_ids() == [2, 3, 1]
    with pytest.raises(AssertionError):
        pool.free_blocks([pool.blocks[3]])  # never taken at all


def test_taking_more_than_free_is_an_assertion_error() -> None:
    pool = BlockPool(4)
    with pytest.raises(AssertionError):
        pool.get_new_blocks(4)
    assert pool.free_queue.block_ids() == [1, 2, 3]


def test_cache_changes_report_what_entered_and_left_since_the_last_take() -> None:
    """A data-parallel replica reports its prefix cache's changes each step: each hash once, in its final state."""
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 11)
    assert pool.take_cache_changes() == ([], [])  # not tracking yet
    pool.track_cache_changes()
    assert pool.take_cache_changes() == ([11], [])  # what was cached already counts as entered
    pool.cache_block(b, 22)
    pool.free_blocks([a, b])
    assert pool.take_cache_changes() == ([22], [])  # freed blocks stay cached
    c = pool.get_new_blocks(1)[0]  # evicts the least recently freed: a (hash 11)
    assert c is a and pool.take_cache_changes() == ([], [11])
    pool.cache_block(c, 33)
    pool.free_blocks([c])
    pool.get_new_blocks(2)  # evicts 22 and 33 (33 entered and left within this "step")
    stored, evicted = pool.take_cache_changes()
    assert stored == [] and sorted(evicted) == [22, 33]
    assert pool.take_cache_changes() == ([], [])
