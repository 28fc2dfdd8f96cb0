"""A picture of the KV pool between two steps: who holds each block, and the paper's accounting of the
slots (token states, internal fragmentation, reservation, free). The server's /kv page draws it."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.request import Request

FREE, CACHED_FREE, NULL = -1, -2, -3
"""Owner codes of blocks no request holds: free, free but still holding a prefix-cached full block (reused
if its tokens come again), and the null block (padding of block tables, never handed out)."""


def kv_map(manager: KVCacheManager, requests: Mapping[str, Request], cells: bool = True) -> dict[str, Any]:
    """The pool now. ``accounting`` (in token slots; shared blocks counted once): ``token_states`` (slots
    holding a computed token's K/V), ``internal_fragmentation`` (the unfilled tail of blocks with some),
    ``reserved`` (held blocks with nothing computed yet: the step about to run fills them), ``free`` and, of
    it, ``cached_free``; block counts ``used_blocks``, ``shared_blocks`` (ref_cnt > 1), ``usable_blocks``.
    With ``cells``, per block: ``owner`` (an index into ``requests``: the first holder, or a code above),
    ``refs`` (holders) and ``filled`` (slots with K/V); and ``integrity``, the pool's invariants checked."""
    pool, bs = manager.block_pool, manager.block_size
    filled = [0] * pool.num_blocks
    owner = [FREE] * pool.num_blocks
    owner[pool.null_block.block_id] = NULL
    holders: list[str] = []
    for req_id, blocks in manager.req_to_blocks.items():
        request = requests.get(req_id)
        computed = request.num_computed_tokens if request is not None else 0
        index = len(holders)
        holders.append(req_id)
        for i, block in enumerate(blocks):
            if block is pool.null_block:  # a sliding window's freed block
                continue
            if owner[block.block_id] < 0:
                owner[block.block_id] = index
            filled[block.block_id] = max(filled[block.block_id], min(bs, max(0, computed - i * bs)))
    used = shared = token_states = fragmentation = reserved = cached_free = 0
    for block in pool.blocks[1:]:
        if block.ref_cnt == 0:
            if block.block_hash is not None:
                owner[block.block_id] = CACHED_FREE
                cached_free += 1
            continue
        used += 1
        shared += block.ref_cnt > 1
        n = filled[block.block_id]
        token_states += n
        if n == 0:
            reserved += bs
        else:
            fragmentation += bs - n
    free_blocks = pool.num_usable_blocks - used
    state: dict[str, Any] = {
        "block_size": bs, "num_blocks": pool.num_blocks,
        "accounting": {"token_states": token_states, "internal_fragmentation": fragmentation, "reserved": reserved,
                       "free": free_blocks * bs, "cached_free": cached_free * bs, "used_blocks": used,
                       "shared_blocks": shared, "free_blocks": free_blocks, "usable_blocks": pool.num_usable_blocks},
    }
    if cells:
        state.update(requests=holders, owner=owner, refs=[b.ref_cnt for b in pool.blocks], filled=filled,
                     integrity=integrity(manager))
    return state


def integrity(manager: KVCacheManager) -> str:
    """"ok" when the pool's invariants hold (KVCacheManager.check_integrity), else the first one broken."""
    try:
        manager.check_integrity()
    except AssertionError as e:
        return f"broken: {e}"
    return "ok"
