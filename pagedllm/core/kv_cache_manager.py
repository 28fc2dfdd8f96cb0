"""Maps requests to the physical blocks that hold their K/V (their block tables)."""
from __future__ import annotations

from collections import Counter

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class KVCacheManager:
    """Allocates blocks on demand as requests grow and frees them the moment they finish."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def usage(self) -> float:
        """Fraction of usable KV blocks in use."""
        return self.block_pool.usage()

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        Returns the newly taken blocks (maybe none), or None when the pool has too few free
        blocks; then nothing changes and the caller may preempt and retry.
        """
        assert num_new_tokens > 0
        held = self.req_to_blocks.get(request.request_id, [])
        needed = self.num_blocks_needed(request.num_computed_tokens + num_new_tokens) - len(held)
        if needed > self.block_pool.num_free_blocks:
            return None
        new_blocks = self.block_pool.get_new_blocks(max(needed, 0))
        self.req_to_blocks[request.request_id] = held + new_blocks
        return new_blocks

    def free(self, request: Request) -> None:
        """Return all of the request's blocks; the tail goes first so it is evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def check_integrity(self) -> bool:
        """Assert the pool's invariants; True when they hold.

        Every reference in a block table is counted in ref_cnt; the free queue holds exactly
        the blocks with ref_cnt 0; the null block is in no table and not in the free queue;
        free + used == usable.
        """
        pool = self.block_pool
        refs = Counter(b.block_id for blocks in self.req_to_blocks.values() for b in blocks)
        assert pool.null_block.ref_cnt == 0 and 0 not in refs, "null block handed out"
        assert pool.null_block not in pool.free_queue, "null block in the free queue"
        for block in pool.blocks[1:]:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {refs.get(block.block_id, 0)} references")
            assert (block.ref_cnt == 0) == (block in pool.free_queue), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in free queue: {block in pool.free_queue}")
        used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
        assert used + pool.num_free_blocks == pool.num_usable_blocks
        return True
