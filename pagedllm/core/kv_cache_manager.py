"""Maps requests to the physical blocks that hold their K/V (their block tables).

Blocks are taken on demand and returned the moment a request finishes. Full blocks are
hashed (prefix caching) so a later request with the same prefix reuses them; forked
sequences (parallel samples, beams) share their parent's blocks by reference count, and the
partly filled last block is copied on write.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Iterator, Sequence

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int], salt: str | None = None) -> int:
    """Chained hash of one full block: the parent block's hash, the tokens, and a salt if any."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update((parent_hash or 0).to_bytes(16, "little"))
    digest.update(array("q", token_ids).tobytes())
    if salt:
        digest.update(salt.encode())
    return int.from_bytes(digest.digest(), "little")


ROUTING_KEY_MASK = (1 << 64) - 1
"""A block hash's low 64 bits name it between processes (a message carries 64-bit integers)."""


def iter_routing_keys(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> Iterator[int]:
    """The routing keys (low 64 bits of the chained hashes) of a prompt's full blocks, first block first, hashed
    as they are taken: what a data-parallel front matches against the keys each replica reports cached
    (BlockPool.take_cache_changes)."""
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], salt if start == 0 else None)
        yield parent & ROUTING_KEY_MASK


def prompt_routing_keys(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    """All of ``iter_routing_keys``."""
    return list(iter_routing_keys(token_ids, block_size, salt))


class KVCacheManager:
    """Block tables of all requests, over one BlockPool."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_host_blocks: int = 0, sliding_window: int | None = None) -> None:
        """``sliding_window``: every layer of the model attends to the last this many positions only, so a
        request's blocks that fall wholly before its window go back to the pool (the null block takes
        their place in its table)."""
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self.host_free: list[int] = list(range(num_host_blocks - 1, -1, -1))
        """Free blocks of the host (swap) pool; taken from the end."""
        self.num_host_blocks = num_host_blocks
        self.req_to_host_blocks: dict[str, list[int | None]] = {}
        """Swapped-out requests -> the host blocks holding their K/V, in table order (None: a block freed
        outside a sliding window)."""
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        """Request id -> how many of its leading blocks are already in the prefix cache."""
        self.pending_copies: list[tuple[int, int]] = []
        """(source, destination) block ids to copy before the next forward (copy-on-write)."""
        self._replaced_tables: set[str] = set()
        """Requests whose block table changed other than by appending blocks since the scheduler last
        sent it (started from nothing, swapped in, a block copied on write): see take_replaced_table."""

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def usage(self) -> float:
        """Fraction of usable KV blocks in use."""
        return self.block_pool.usage()

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # -------------------------------------------------------------------- prefix cache
    def block_hashes(self, request: Request) -> list[int]:
        """Hashes of the request's full blocks, extended lazily as its tokens grow."""
        hashes, bs = request.block_hashes, self.block_size
        while len(hashes) < request.num_tokens // bs:
            start = len(hashes) * bs
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None,
                                            request.all_token_ids[start:start + bs],
                                            None if hashes else request.block_hash_salt))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The cached blocks of the request's longest cached prefix, and how many tokens they hold.

        At least one token is always left to compute (it yields the logits to sample from).
        """
        if not self.enable_caching:
            return [], 0
        hits: list[KVCacheBlock] = []
        for block_hash in self.block_hashes(request)[: (request.num_tokens - 1) // self.block_size]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        if not self.enable_caching:
            return
        done = self.num_cached_blocks.get(request.request_id, 0)
        full = min(num_tokens, request.num_tokens) // self.block_size
        hashes = self.block_hashes(request)
        for i in range(done, full):
            if blocks[i] is not self.block_pool.null_block:  # a placeholder outside a sliding window holds nothing
                self.block_pool.cache_block(blocks[i], hashes[i])
        self.num_cached_blocks[request.request_id] = max(done, full)

    # -------------------------------------------------------------------- allocation
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: Sequence[KVCacheBlock] = (),
                       num_lookahead_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones, and ``num_lookahead_tokens``
        slots past them (a draft model's drafts).

        ``computed_blocks`` are prefix-cache hits for a request that holds no blocks yet (its
        computed tokens then start after them). Returns the newly taken blocks (maybe none),
        or None when the pool has too few free blocks; then nothing changes.
        """
        assert num_new_tokens > 0
        held = self.req_to_blocks.get(request.request_id, [])
        assert not (held and computed_blocks), "cache hits only for a request without blocks"
        if held and self.sliding_window is not None:
            self._free_outside_window(request, held)
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = (self.num_blocks_needed(num_computed + num_new_tokens + num_lookahead_tokens) - len(held)
                  - len(computed_blocks))
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)  # cached but free: they leave the free queue
        copy = 1 if self._writes_into_shared_block(held, num_computed) else 0
        if max(needed, 0) + revived + copy > self.block_pool.num_free_blocks:
            return None
        self.block_pool.touch(computed_blocks)
        blocks = held + list(computed_blocks)
        if copy:
            self._copy_on_write(request, blocks)
        new_blocks = self.block_pool.get_new_blocks(max(needed, 0))
        blocks += new_blocks
        if not held:  # a table started from nothing (new, or preempted and back)
            self._replaced_tables.add(request.request_id)
        self.req_to_blocks[request.request_id] = blocks
        if computed_blocks:
            self.num_cached_blocks[request.request_id] = len(computed_blocks)
        self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return new_blocks

    def _free_outside_window(self, request: Request, blocks: list[KVCacheBlock]) -> None:
        """Return the blocks no query of this step or later can see: the step's first new token sits at
        num_computed_tokens and sees positions from num_computed_tokens - window + 1 on."""
        first_needed = max(0, request.num_computed_tokens - self.sliding_window + 1) // self.block_size
        null = self.block_pool.null_block
        gone = []  # the freed blocks are a prefix: walk back from the window's start to the last placeholder
        i = min(first_needed, len(blocks) - 1) - 1
        while i >= 0 and blocks[i] is not null:
            gone.append(i)
            i -= 1
        if not gone:
            return
        self.block_pool.free_blocks(blocks[i] for i in gone)  # cached ones stay findable until reused
        for i in gone:
            blocks[i] = null
        self._replaced_tables.add(request.request_id)

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens ever holds at once (computed ``max_chunk`` tokens
        per step at most): all of them, or under a sliding window the window's and one chunk's."""
        blocks = self.num_blocks_needed(num_tokens)
        if self.sliding_window is None:
            return blocks
        return min(blocks, self.num_blocks_needed(self.sliding_window - 1 + max_chunk) + 1)

    def _writes_into_shared_block(self, held: list[KVCacheBlock], num_computed: int) -> bool:
        """The next token lands in a partly filled last block that other sequences also hold."""
        return bool(held) and num_computed % self.block_size != 0 and held[-1].ref_cnt > 1

    def _copy_on_write(self, request: Request, blocks: list[KVCacheBlock]) -> None:
        shared = blocks[-1]
        private = self.block_pool.get_new_blocks(1)[0]
        self.pending_copies.append((shared.block_id, private.block_id))
        self.block_pool.free_blocks([shared])  # one holder fewer; the others keep it
        blocks[-1] = private
        self._replaced_tables.add(request.request_id)

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's blocks by reference (it continues from the same K/V)."""
        blocks = self.req_to_blocks[parent.request_id]
        self.block_pool.touch(b for b in blocks if b is not self.block_pool.null_block)
        self.req_to_blocks[child.request_id] = list(blocks)
        self.num_cached_blocks[child.request_id] = self.num_cached_blocks.get(parent.request_id, 0)
        child.block_hashes = list(parent.block_hashes[: len(child.all_token_ids) // self.block_size])

    def trim(self, request: Request, num_tokens: int) -> None:
        """Return the request's blocks wholly past its first ``num_tokens`` slots (rejected draft tokens' slots);
        none of them is in the prefix cache (only full blocks of the request's own tokens are)."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = self.num_blocks_needed(num_tokens)
        if blocks is None or len(blocks) <= keep:
            return
        tail = blocks[keep:]
        assert all(b.block_hash is None for b in tail), "a cached block past the request's tokens"
        del blocks[keep:]
        self.block_pool.free_blocks(reversed(tail))
        self._replaced_tables.add(request.request_id)

    def free(self, request: Request) -> None:
        """Return all of the request's blocks; the tail goes first so it is evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self._replaced_tables.discard(request.request_id)
        self.block_pool.free_blocks(b for b in reversed(blocks) if b is not self.block_pool.null_block)

    # -------------------------------------------------------------------- swap
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's K/V to host blocks: (device, host) pairs to copy, or None if the host pool is full.

        Its device blocks are released (blocks shared with others stay theirs).
        """
        null = self.block_pool.null_block
        blocks = self.req_to_blocks.get(request.request_id, [])
        live = [b for b in blocks if b is not null]  # blocks freed outside a sliding window stay null
        if len(live) > len(self.host_free):
            return None
        host = [None if b is null else self.host_free.pop() for b in blocks]
        self.req_to_host_blocks[request.request_id] = host
        mapping = [(b.block_id, h) for b, h in zip(blocks, host) if h is not None]
        self.free(request)
        return mapping

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped-out request back with room for ``num_new_tokens`` more tokens.

        Returns (host, device) pairs to copy, or None (nothing changes) if the device pool is short.
        """
        host = self.req_to_host_blocks[request.request_id]
        if self.sliding_window is not None:  # what fell out of the window meanwhile is not brought back
            self._free_host_before_window(host, request.num_computed_tokens)
        live = [h for h in host if h is not None]
        total = self.num_blocks_needed(request.num_computed_tokens + num_new_tokens) - (len(host) - len(live))
        if max(total, len(live)) > self.block_pool.num_free_blocks:
            return None
        fresh = iter(self.block_pool.get_new_blocks(len(live)))
        blocks = [self.block_pool.null_block if h is None else next(fresh) for h in host]
        del self.req_to_host_blocks[request.request_id]
        self.host_free.extend(reversed(live))
        self.req_to_blocks[request.request_id] = blocks
        self._replaced_tables.add(request.request_id)
        return [(h, b.block_id) for h, b in zip(host, blocks) if h is not None]

    def _free_host_before_window(self, host: list[int | None], num_computed_tokens: int) -> None:
        """Free the host blocks of a swapped-out table that lie wholly before its sliding window (None in place)."""
        first_needed = max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size
        for i in range(min(first_needed, len(host) - 1)):
            if host[i] is not None:
                self.host_free.append(host[i])
                host[i] = None

    def is_swapped(self, request_id: str) -> bool:
        """The request's K/V wait in the host pool (it was preempted by swapping)."""
        return request_id in self.req_to_host_blocks

    def free_host(self, request: Request) -> None:
        """Drop a swapped-out request's host blocks (it was aborted while swapped out)."""
        self.host_free.extend(h for h in reversed(self.req_to_host_blocks.pop(request.request_id, [])) if h is not None)

    def take_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write work for the workers since the last call."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as physical block ids (empty if it holds none)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def take_replaced_table(self, request_id: str) -> bool:
        """Whether the request's table changed other than by appending blocks since the last call.

        True once after the table was started from nothing (a new request, or one resumed after
        a recompute preemption), swapped in, or had its last block copied on write: workers then
        need the whole table, not just the new blocks.
        """
        if request_id in self._replaced_tables:
            self._replaced_tables.discard(request_id)
            return True
        return False

    def check_integrity(self) -> bool:
        """Assert the pool's invariants; True when they hold.

        Every reference in a block table is counted in ref_cnt; the free queue holds exactly
        the blocks with ref_cnt 0; the null block is not in the free queue and in tables only as
        the placeholder of blocks freed outside a sliding window (never last);
        the prefix cache maps each hash to a block carrying that hash; free + used == usable.
        """
        pool = self.block_pool
        # a sliding window's freed blocks are null placeholders in tables: not references
        refs = Counter(b.block_id for blocks in self.req_to_blocks.values() for b in blocks if b is not pool.null_block)
        assert pool.null_block.ref_cnt == 0, "null block handed out"
        assert all(blocks[-1] is not pool.null_block for blocks in self.req_to_blocks.values() if blocks), \
            "a table ends in the null block"
        assert pool.null_block not in pool.free_queue, "null block in the free queue"
        for block in pool.blocks[1:]:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {refs.get(block.block_id, 0)} references")
            assert (block.ref_cnt == 0) == (block in pool.free_queue), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in free queue: {block in pool.free_queue}")
        for block_hash, block in pool.cached_blocks.items():
            assert block.block_hash == block_hash, f"block {block.block_id} cached under a hash it does not carry"
        used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
        assert used + pool.num_free_blocks == pool.num_usable_blocks
        assert self._replaced_tables <= set(self.req_to_blocks), "a replaced table nobody holds"
        host_used = [h for blocks in self.req_to_host_blocks.values() for h in blocks if h is not None]
        assert len(set(host_used)) == len(host_used) and not set(host_used) & set(self.host_free)
        assert len(host_used) + len(self.host_free) == self.num_host_blocks, "host blocks leaked"
        return True
