"""The pool of physical KV blocks: reference counts, a null block, an LRU free queue and the
prefix cache (full blocks keyed by the chained hash of their tokens).

A freed block keeps its hash while it waits in the free queue: until it is taken for new
tokens (evicted, least recently freed first) a request with the same prefix can revive it.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(eq=False)
class KVCacheBlock:
    """One physical block of ``block_size`` token slots in every layer's K/V tensors."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    """Chained hash of a full block's tokens (prefix caching); None while not cached."""


class FreeBlockQueue:
    """Free blocks in eviction order: the least recently freed first (O(1) push, pop, remove)."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._queue

    def popleft(self) -> KVCacheBlock:
        return self._queue.popitem(last=False)[1]

    def append(self, block: KVCacheBlock) -> None:
        assert block.block_id not in self._queue, f"block {block.block_id} freed twice"
        self._queue[block.block_id] = block

    def remove(self, block: KVCacheBlock) -> None:
        del self._queue[block.block_id]

    def block_ids(self) -> list[int]:
        """Free block ids in eviction order."""
        return list(self._queue)

    def blocks(self) -> list[KVCacheBlock]:
        """Free blocks in eviction order."""
        return list(self._queue.values())


class BlockPool:
    """All KV blocks. Block 0 is the null block: never handed out, used to pad block tables."""

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 2, "need the null block and at least one usable block"
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_blocks: dict[int, KVCacheBlock] = {}
        """Block hash -> the block holding those tokens (held or free)."""
        self.cache_changes: dict[int, bool] | None = None
        """With ``track_cache_changes()``: block hash -> whether it is cached now, for each hash cached or evicted
        since the last ``take_cache_changes()`` (a data-parallel front routes by what each replica holds)."""

    def track_cache_changes(self) -> None:
        """Start recording which block hashes enter and leave the prefix cache (what is cached now counts as
        entered)."""
        self.cache_changes = dict.fromkeys(self.cached_blocks, True)

    def take_cache_changes(self) -> tuple[list[int], list[int]]:
        """The hashes cached and the hashes evicted since the last call (each hash in one list: its state now)."""
        changes = self.cache_changes or {}
        if self.cache_changes is not None:
            self.cache_changes = {}
        return [h for h, cached in changes.items() if cached], [h for h, cached in changes.items() if not cached]

    @property
    def num_blocks(self) -> int:
        """All blocks, the null block included."""
        return len(self.blocks)

    @property
    def num_usable_blocks(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` free blocks (least recently freed first), each with ref_cnt 1."""
        assert num_blocks <= len(self.free_queue), "caller checks num_free_blocks first"
        taken = [self.free_queue.popleft() for _ in range(num_blocks)]
        for block in taken:
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            self._evict(block)
        return taken

    def _evict(self, block: KVCacheBlock) -> None:
        """Forget a block's cached tokens (it is about to hold others)."""
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
                if self.cache_changes is not None:
                    self.cache_changes[block.block_hash] = False
            block.block_hash = None

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: int) -> None:
        """Record that ``block`` holds the full block of tokens named by ``block_hash``."""
        assert block.block_hash is None or block.block_hash == block_hash
        if block_hash not in self.cached_blocks:  # an identical block may be cached already: keep that one
            self.cached_blocks[block_hash] = block
            block.block_hash = block_hash
            if self.cache_changes is not None:
                self.cache_changes[block_hash] = True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each block (reviving cached free blocks out of the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks nobody holds go to the free queue's end."""
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def reset_prefix_cache(self) -> int:
        """Forget the cached tokens of every free block (blocks requests hold keep theirs); how many were cached."""
        cached = [b for b in self.free_queue.blocks() if b.block_hash is not None]
        for block in cached:
            self._evict(block)
        return len(cached)

    def usage(self) -> float:
        """Fraction of usable blocks currently held by requests (0.0 - 1.0)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks
