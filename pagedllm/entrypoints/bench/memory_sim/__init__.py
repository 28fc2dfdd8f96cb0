"""The KV-memory simulator behind ``pagedllm bench memory``: the PagedAttention paper's waste analysis.

It replays seeded synthetic traces (:mod:`pagedllm.entrypoints.bench.traces`, ``--seed``,
default 0) through the real ``Scheduler`` / ``KVCacheManager`` (with a fake model runner that
emits one token per request that needs a sample) and through three contiguous-reservation
baselines of the same KV memory, and reports where the memory goes. The default arrival rate
(``--request-rate``) is per trace the *saturating* rate
``kv_slots / mean(output * (prompt + (output - 1) / 2))``: by Little's law the K/V the
arriving requests hold on average then equals the whole pool, so the pool is under pressure
(for Alpaca the ``max_num_seqs`` limit binds first). Each request produces exactly its
output length (``ignore_eos``).

Schemes, all with ``kv_slots = (kv_tokens // block_size) * block_size`` token slots and the
same ``max_num_seqs`` / ``max_num_batched_tokens`` limits:

- ``paged`` (:mod:`.paged`): the real scheduler with ``CacheConfig(block_size)`` and
  ``kv_tokens // block_size + 1`` blocks (block 0 is the null block). Prompts are chunked
  under the token budget, preemption is by recompute, exactly as in the engine.
- ``orca-max`` / ``orca-pow2`` / ``orca-oracle`` (:mod:`.contiguous`): each request reserves,
  at admission, one contiguous extent of max_model_len slots / the next power of two
  >= prompt + output (at most max_model_len) / exactly prompt + output. Extents are taken
  first-fit from the free extents of [0, kv_slots) and returned (and merged) when the request
  finishes. Admission is iteration-level and FCFS: the head of the queue joins when an extent
  fits, fewer than max_num_seqs run, and its whole prompt fits the step's token budget
  (running requests take one token each first; a prompt larger than the whole budget runs
  alone). The whole prompt is computed in its first step, then one token per step.

Accounting (:mod:`.series`): K/V is sampled once per step, after the step's tokens are
computed and before finished requests are freed. The slots of the pool are split into

- token states: K/V actually held (the sum of ``num_computed_tokens`` of running requests);
- reserved: slots held for future tokens a running request will still produce;
- internal fragmentation: slots held beyond what a request will ever use (paged: the
  unfilled tail of each request's last block; Orca: padding of the reservation beyond
  prompt + output);
- external fragmentation: free slots while the FCFS head of the queue waits because its
  reservation is larger than the largest free extent (never for paged: any free block fits);
- unused: all other free slots (nothing waits, or only max_num_seqs / the token budget
  blocks admission). Unused slots are not waste and are left out of the percentages.

Each percentage is a ratio of sums over the busy steps (those that compute something):
``sum(category) / sum(token states + reserved + internal + external)``, so the four columns
add up to 100% and nearly empty steps weigh little. Paged waste is ``1 - token states``.

Sharing (:mod:`.sharing`, ``--sharing-traces``, default alpaca): for each request of the
trace, blocks held at every generation step (K/V of prompt + g tokens, g = 0 .. output - 1)
with and without sharing, summed over steps and requests; saving = 1 - shared / unshared.

- Parallel sampling, n samples: without sharing every sample holds its own copy of the
  prompt; with sharing the prompt's full blocks are held once, the last partial prompt
  block is shared until the first write (copy-on-write, then one copy per sample), and
  generated tokens' blocks are per sample. All samples have the request's output length.
  When ``KVCacheManager`` has ``fork`` this is measured on the real manager (the prompt is
  allocated once, the samples forked from it, each grown by ``allocate_slots``); otherwise
  it is counted with the rule above (the two agree exactly; the tests check it).
- Beam search, width k (a model, not a search): the k beams share the prompt and all
  generated tokens more than ``--beam-divergence`` tokens (default 32) behind the newest
  position; the blocks holding the last ``--beam-divergence`` tokens are per beam. The
  savings depend on this assumption.

:mod:`.benchmark` holds the options (``MemoryBenchConfig``) and runs every scheme on every
trace. The package is pure Python (no torch) and uses ``pagedllm.core`` directly, the one
part of ``entrypoints`` the layering allows to.
"""
