"""Memory saved by block sharing: parallel sampling (on the real manager) and a beam-search model."""
from __future__ import annotations

from collections.abc import Iterable

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.entrypoints.bench.traces import TraceRequest
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

SAMPLE_TOKEN_BASE = 1_000_000
"""Token id that sample i generates is SAMPLE_TOKEN_BASE + i (prompt tokens are smaller)."""


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for positive b."""
    return -(-a // b)


def parallel_sampling_blocks(prompt_len: int, output_len: int, n: int, block_size: int) -> tuple[int, int]:
    """(unshared, shared) block-steps of one request with n parallel samples."""
    shared_prompt = prompt_len // block_size
    unshared = shared = 0
    for num_tokens in range(prompt_len, prompt_len + output_len):
        blocks = cdiv(num_tokens, block_size)
        unshared += n * blocks
        shared += blocks if num_tokens == prompt_len else shared_prompt + n * (blocks - shared_prompt)
    return unshared, shared


def beam_search_blocks(prompt_len: int, output_len: int, width: int, block_size: int,
                       divergence: int) -> tuple[int, int]:
    """(unshared, shared) block-steps of one request under the beam model (package docstring)."""
    unshared = shared = 0
    for num_tokens in range(prompt_len, prompt_len + output_len):
        blocks = cdiv(num_tokens, block_size)
        common = max(prompt_len, num_tokens - divergence) // block_size  # full blocks all beams share
        unshared += width * blocks
        shared += blocks if num_tokens == prompt_len else common + width * (blocks - common)
    return unshared, shared


def forked_sampling_block_steps(manager: KVCacheManager, item: TraceRequest, n: int) -> int:
    """Shared block-steps of one request with n samples, measured on the real KVCacheManager.

    The prompt is allocated once, n - 1 samples are forked from it (``fork``), then every
    sample grows a block at a time; the manager copies the shared partial block on write.
    Blocks in use only change at block boundaries, so each sample advances to the end of
    its current block in one ``allocate_slots`` call and the count is weighted by the tokens.
    """
    pool, bs = manager.block_pool, manager.block_size
    prompt, last = [item.index + 1] * item.prompt_len, item.total_len - 1
    params = SamplingParams(max_tokens=item.output_len, ignore_eos=True)
    samples = [Request(f"{item.index}.{i}", prompt, params, None, item.output_len) for i in range(n)]
    assert manager.allocate_slots(samples[0], item.prompt_len) is not None, "pool sized for the request"
    for child in samples[1:]:
        manager.fork(samples[0], child)
    for sample in samples:
        sample.num_computed_tokens = item.prompt_len
    in_use = pool.num_usable_blocks - pool.num_free_blocks
    block_steps, stored = in_use, item.prompt_len  # the step that computed the prompt
    while stored < last:
        end = min(last, cdiv(stored + 1, bs) * bs)  # K/V of stored + 1 .. end lie in the same blocks
        for i, sample in enumerate(samples):
            for _ in range(end - stored):
                sample.append_output_token(SAMPLE_TOKEN_BASE + i)  # distinct per sample: no shared cache hits
            assert manager.allocate_slots(sample, end - stored) is not None, "pool sized for the request"
            sample.num_computed_tokens = end
        block_steps += (pool.num_usable_blocks - pool.num_free_blocks) * (end - stored)
        stored = end
    for sample in samples:
        manager.free(sample)
    return block_steps


def sharing_savings(trace: list[TraceRequest], block_size: int, max_model_len: int, widths: Iterable[int],
                    divergence: int, use_manager: bool) -> list[dict[str, float | int | str]]:
    """Saving by block sharing for parallel sampling and beam search at each width.

    Parallel sampling is measured on the real KVCacheManager when ``use_manager`` (and it can
    fork), else counted by ``parallel_sampling_blocks``; beam search is always the model.
    """
    rows = []
    for mode in ("parallel_sampling", "beam_search"):
        for width in widths:
            method = "KVCacheManager.fork" if use_manager and mode == "parallel_sampling" else "analytic"
            manager = KVCacheManager(width * cdiv(max_model_len, block_size) + 1, block_size) if (
                method != "analytic") else None
            unshared = shared = 0
            for item in trace:
                if mode == "beam_search":
                    u, s = beam_search_blocks(item.prompt_len, item.output_len, width, block_size, divergence)
                else:
                    u, s = parallel_sampling_blocks(item.prompt_len, item.output_len, width, block_size)
                    if manager is not None:
                        s = forked_sampling_block_steps(manager, item, width)
                unshared, shared = unshared + u, shared + s
            rows.append({"mode": mode, "width": width, "method": method, "unshared_block_steps": unshared,
                         "shared_block_steps": shared, "saving_pct": 100.0 * (1 - shared / unshared)})
    return rows
