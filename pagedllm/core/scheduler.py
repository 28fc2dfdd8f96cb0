"""Iteration-level scheduler: which requests run in the next step, and how many tokens each.

``schedule()`` decides one step within a token budget (max_num_batched_tokens) and, when set, an attention
budget (max_num_batched_attention: query x key positions, what a prompt chunk's attention costs grows with):

1. Running requests, oldest first, each get the tokens they still lack (a prompt or the rest of
   it, chunked when a budget runs out, or one decode token). When the KV pool cannot hold
   them the newest running request is preempted: its K/V go to the host pool (preemption_mode
   "swap", while it has room) or are dropped to be recomputed, and it returns to the front of
   the waiting queue.
2. Unless step 1 preempted, waiting requests are admitted in arrival order while the budget,
   max_num_seqs and the pool allow; the first that does not fit stops admission. A request whose
   LoRA adapter would make more than max_loras adapters run at once is passed over (it keeps its
   place in the queue). A new request
   starts after its longest prefix found in the prefix cache; a swapped-out one is swapped back.
3. The other samples of an n > 1 request fork off their leader once its prompt is computed,
   sharing its blocks (the partly filled last block is copied on write later).

A prompt chunk of c tokens from position p attends c * p + c * (c + 1) / 2 positions: the attention budget
shrinks late chunks of a long prompt, so a step costs about what a full first chunk does and the decode
tokens beside it keep their pace. Decode tokens are never held back by it (they count in it), and the step's
first prompt chunk always gets at least one block, so every prompt progresses.

With step_time_target, a step that also decodes gives its prompt chunks what the StepTimeModel (core/step_time.py,
taught by record_step_time) estimates fits max(target - decode time, decode time) seconds, so decoding streams
keep a bounded gap; without a decode the chunks are whole (full throughput).

Speculative decoding: a decoding request with draft tokens (``Request.spec_token_ids``, proposed by the
workers after the last step) gets slots for them too, within the budget, max_tokens and max_model_len; the
drafts count in the token budget. ``update_from_output()`` takes back the rejected ones: num_computed_tokens
steps back and the blocks wholly past the request's tokens and its next drafts return to the pool. Only full
blocks of accepted tokens are ever hashed for the prefix cache (drafts are not tokens of the request).

The SchedulerOutput tells the workers about new requests in full, known ones by their new
blocks (the whole table when it changed in place), forks, block copies and swaps, and the
requests finished since the last step. ``update_from_output()`` appends the sampled tokens,
applies the stop conditions and frees a finished request's blocks at once.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.block_pool import KVCacheBlock
from pagedllm.core.in_flight import InFlight
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler_output import CachedRequestData, ForkedRequestData, NewRequestData, SchedulerOutput
from pagedllm.core.step_time import StepTimeModel, attended_positions
from pagedllm.errors import ValidationError
from pagedllm.outputs import EngineCoreOutput, ModelRunnerOutput, TokenLogprobs
from pagedllm.request import Request, RequestStatus

UNBOUNDED_ATTENTION = 2**62
"""The attention budget of a step when max_num_batched_attention is unset: more than any step attends."""


@dataclass(kw_only=True)
class SchedulerStats:
    """Counters since start, and the state after the last step."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_chunked_prefills: int = 0
    """Times a prompt was scheduled only in part because of the token budget."""
    max_num_running: int = 0
    max_batches_in_flight: int = 0
    """The most batches in flight at once, counted with pipeline stages (engine/batch_queue.py; 0 otherwise)."""
    num_prompt_tokens_computed: int = 0
    num_generated_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    max_kv_cache_usage: float = 0.0
    max_step_attended_positions: int = 0
    """The most query x key positions one step attended (bounded by max_num_batched_attention, see there)."""
    prefix_cache_queries: int = 0
    """Tokens of newly scheduled requests looked up in the prefix cache."""
    prefix_cache_hits: int = 0
    """Of those, tokens found (their K/V reused, not computed)."""
    num_swapped_out: int = 0
    num_swapped_in: int = 0
    num_forks: int = 0
    """Sequences started from another's blocks (parallel samples, beams)."""
    spec_decode_num_drafts: int = 0
    """Draft sequences verified (one per speculating request and step; vLLM's spec_decode_num_drafts)."""
    spec_decode_num_draft_tokens: int = 0
    """Draft tokens verified."""
    spec_decode_num_accepted_tokens: int = 0
    """Draft tokens accepted."""
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    """Per draft position (0 first): drafts accepted there."""
    step_time_decode_s: float = 0.0
    """The step-time model's seconds of a step's decode part (0: not measured yet; it learns with the target off
    too, never changing a step then)."""
    step_time_token_s: float = 0.0
    """The step-time model's seconds of one prompt token's work outside attention (0: not measured yet)."""
    step_time_pair_s: float = 0.0
    """The step-time model's seconds of one attended query x key pair of a prompt chunk (0: not measured yet)."""
    last_step_estimated_s: float = 0.0
    """The estimated seconds of the last step (when it was scheduled; 0 with step_time_target off)."""
    max_step_estimated_s: float = 0.0
    """The most estimated seconds of a step whose prompt chunks step_time_target bounded (beside decodes), a step
    whose first chunk was held at a block (the floor) left out."""
    max_step_estimated_fraction: float = 0.0
    """Of those steps, the most estimated seconds as a fraction of what the rule allowed them (max(target,
    2 x the decode estimate)): at most 1."""
    num_step_time_shrunk_chunks: int = 0
    """Prompt chunks step_time_target made smaller than the other budgets allowed."""


@dataclass
class _StepPlan:
    """What one schedule() call decided so far, and its remaining budget."""

    token_budget: int
    attention_budget: int
    """Query x key positions the step may still attend (negative once decodes alone went past it)."""
    output: SchedulerOutput
    now: float
    preempted: bool = False
    has_prompt_chunk: bool = False
    """A prompt chunk (more than one new token) is in the step: later ones get no floor of a block."""
    prefill_budget: float | None = None
    """What the step's prompt chunks may still cost (StepTimeModel.cost; None: no step-time cap)."""
    prefill_tokens: int = 0
    prefill_pairs: int = 0
    """The step's prompt chunks: tokens and attended pairs (what its measured time teaches the step-time model)."""
    prefill_cost: float = 0.0
    """Their StepTimeModel.cost when scheduled."""
    decodes: bool = False
    """The step carries a decode token."""
    shrunk_by_time: bool = False
    """The chunk last sized was cut by the step-time cap (counted if it goes in the batch)."""
    floored: bool = False
    """A chunk was held at a block past the step-time or attention budget (the step's first)."""
    allowed_s: float = 0.0
    """Seconds the step-time rule allows this step (with prefill_budget)."""
    seq_budget: int = 1 << 62
    """Requests the batch may still take (with batches in flight: its share of them, so the stages get several)."""
    forking_leaders: list[Request] = field(default_factory=list)
    """Leaders whose prompt completes this step: their pending samples fork off after scheduling."""


class Scheduler:
    """Owns the request queues and the KV cache manager; decides each step's batch."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_kv_blocks: int,
                 num_host_blocks: int = 0, num_lookahead_tokens: int = 0,
                 step_cost_weights: tuple[float, float] = (1.0, 1.0), batches_in_flight: int | None = None) -> None:
        """``num_lookahead_tokens``: slots kept past a decoding request's scheduled tokens (a draft model
        writes the K/V of its drafts there before they are verified). ``step_cost_weights``: prefill units per
        prompt token and per attended query x key pair (core/step_time.py; the engine core derives them from
        the model's shape). ``batches_in_flight``: pipeline stages, with up to this many batches in flight: each
        carries the tokens sampled since the previous one and at most its share of the requests (core/in_flight.py;
        None: no stages, one batch at a time)."""
        self.config = scheduler_config
        self.num_lookahead_tokens = num_lookahead_tokens
        self.block_size = cache_config.block_size
        self.sliding_window = cache_config.sliding_window
        """Keys a token attends at most (None: all before it), for the attention budget."""
        self.needs_kv_cache = num_kv_blocks > 0
        """False for an encoder-only pooling model (no KV pool: 0 blocks): requests take no blocks."""
        # without a pool the manager is a stand-in of two blocks that no request ever takes
        self.kv_cache_manager = KVCacheManager(num_kv_blocks if self.needs_kv_cache else 2, cache_config.block_size,
                                               cache_config.enable_prefix_caching, num_host_blocks,
                                               cache_config.sliding_window)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.pending_forks: dict[str, list[Request]] = {}
        """Leader id -> the other samples of an n>1 request, forked once the leader's prompt is computed."""
        self._leader_of: dict[str, str] = {}
        self._finished_since_last_step: set[str] = set()
        """Requests the workers knew that finished since the last schedule(): sent with the next one."""
        self._seen_by_workers: set[str] = set()
        self._verifying: dict[str, int] = {}
        """Request -> draft tokens scheduled in the step now running (rolled back in update_from_output)."""
        self.stats = SchedulerStats()
        self.step_time = StepTimeModel(*step_cost_weights)
        """Estimates a step's seconds (for step_time_target), learning from record_step_time()."""
        self._last_step: tuple[int, int, bool] = (0, 0, False)
        """The last scheduled step's prompt tokens, their attended pairs, and whether it decoded."""
        self.in_flight = InFlight(batches_in_flight is not None)
        """Batches scheduled and not yet updated from (several at once only with pipeline stages)."""
        self.batches_in_flight = batches_in_flight or 1

    # ----------------------------------------------------------------- requests in and out
    def add_request(self, request: Request, samples: list[Request] | None = None) -> None:
        """Queue a request; refuse one that could never fit in the pool.

        ``samples``: the other samples of the same prompt (n > 1). They are not scheduled on their
        own: when the leader's prompt is computed they fork from it, sharing its blocks.
        """
        self._check_fits(request)
        if samples and 1 + len(samples) > self.config.max_num_seqs:
            raise ValidationError(f"n={1 + len(samples)} samples can never run together: max_num_seqs is "
                                  f"{self.config.max_num_seqs}", param="n", value=1 + len(samples))
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if samples:
            self.pending_forks[request.request_id] = samples
            for sample in samples:
                self.requests[sample.request_id] = sample
                self._leader_of[sample.request_id] = request.request_id
                sample.prompt_logprobs = sample.prompt_id_scores = None  # the shared prompt: scored by the leader

    def _check_fits(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        if request.pooling_params is not None and request.num_prompt_tokens > self.config.max_num_batched_tokens:
            raise ValidationError(  # pooled inputs are never chunked: one step must hold the whole input
                f"the input has {request.num_prompt_tokens} tokens but one step holds at most "
                f"{self.config.max_num_batched_tokens} (max_num_batched_tokens)", param="input",
                value=request.num_prompt_tokens)
        if not self.needs_kv_cache:
            return
        max_len = request.num_prompt_tokens + request.max_tokens
        needed = self.kv_cache_manager.max_blocks_held(max_len, self.config.max_num_batched_tokens)
        usable = self.kv_cache_manager.block_pool.num_usable_blocks
        if needed > usable:
            raise ValidationError(
                f"request needs up to {needed} KV blocks ({request.num_prompt_tokens} prompt + "
                f"{request.max_tokens} max_tokens) but the pool has only {usable}",
                param="max_tokens", value=request.max_tokens)

    def fork_request(self, parent_id: str, child: Request) -> None:
        """Start ``child`` (same tokens as the running parent but maybe its last) on the parent's blocks."""
        parent = self.requests[parent_id]
        assert parent.status == RequestStatus.RUNNING and child.request_id not in self.requests
        assert child.all_token_ids[:-1] == parent.all_token_ids[:-1]
        child.num_computed_tokens = parent.num_computed_tokens
        child.lora_request = parent.lora_request
        self.kv_cache_manager.fork(parent, child)
        child.status = RequestStatus.RUNNING
        child.first_scheduled_time = parent.first_scheduled_time
        self.requests[child.request_id] = child
        self.running.append(child)
        self.stats.num_forks += 1

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (abort, stop string): their blocks are freed at once."""
        assert status.is_finished
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request_id in self._leader_of:
                self.pending_forks[self._leader_of.pop(request_id)].remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
        self._refresh_gauges()

    def hold(self, request_id: str) -> None:
        """Keep a running request out of the batches and safe from preemption until it finishes (a beam that
        reported, waiting for its search's other beams: core/in_flight.py)."""
        self.in_flight.hold(request_id)

    def has_unfinished_requests(self) -> bool:
        """Requests waiting, running or about to fork: another step has work."""
        return bool(self.requests)

    def drop_kv(self) -> None:
        """Forget every K/V (the pool's memory is about to be released): running requests go back to the queue's
        front to recompute, swapped ones forget their host copies, the prefix cache empties, and the workers'
        states of every request are dropped (each is sent whole again when it is next scheduled)."""
        manager = self.kv_cache_manager
        for request in reversed(self.running):  # (their order kept at the queue's front)
            manager.free(request)
            request.status = RequestStatus.PREEMPTED
            request.num_preemptions += 1
            self.waiting.appendleft(request)
        self.running.clear()
        for request in self.waiting:
            manager.free_host(request)
            request.num_computed_tokens = 0
            request.spec_token_ids = []
        manager.block_pool.reset_prefix_cache()
        manager.take_copies()  # (copy-on-write work on blocks now freed)
        self._finished_since_last_step |= self._seen_by_workers
        self._seen_by_workers.clear()
        self._refresh_gauges()

    # ------------------------------------------------------------------------- schedule
    def step_features(self, out: SchedulerOutput) -> list[float]:
        """[1, tokens, sequences, attended positions / 1000] of a step just scheduled (what its time grows with:
        a decode token attends to its whole context). The capacity planner's cost model is linear in these."""
        tokens = seqs = attended = 0
        for req_id, q in out.num_scheduled_tokens.items():
            after = self.requests[req_id].num_computed_tokens  # already counts the scheduled tokens
            tokens, seqs, attended = tokens + q, seqs + 1, attended + attended_positions(after - q, q)
        return [1.0, float(tokens), float(seqs), attended / 1000.0]

    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch: running requests, then (unless one was preempted) waiting ones."""
        plan = _StepPlan(token_budget=self.config.max_num_batched_tokens,
                         attention_budget=self._attention_limit, output=SchedulerOutput(),
                         now=time.monotonic())
        target = self.config.step_time_target
        if target is not None and any(self._decodes(r) for r in self.running):  # only a decoding stream waits
            plan.prefill_budget = self.step_time.prefill_budget(target)
            plan.allowed_s = max(target, 2 * (self.step_time.decode_s or 0.0))
        if self.batches_in_flight > 1:  # each batch in flight its share of the requests: every stage gets one
            wanting = min(len(self.running) + len(self.waiting), self.config.max_num_seqs)
            plan.seq_budget = max(1, -(-wanting // self.batches_in_flight))
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        self._fork_samples(plan)
        plan.output.blocks_to_copy = self.kv_cache_manager.take_copies()
        plan.output.finished_req_ids = self._finished_since_last_step
        self._finished_since_last_step = set()
        self._update_after_schedule(plan)
        self.in_flight.scheduled(plan.output)
        return plan.output

    def retract(self, out: SchedulerOutput) -> None:
        """The batch just scheduled, which schedules nothing, is not run after all (pipeline stages with batches
        in flight): what it carried goes with the next one."""
        assert out.is_empty, "only an empty batch is taken back"
        self.in_flight.retract(out)
        self._finished_since_last_step |= out.finished_req_ids

    def _schedule_running(self, plan: _StepPlan) -> None:
        index = 0
        while index < len(self.running) and plan.token_budget > 0 and plan.seq_budget > 0:
            request = self.running[index]
            # in a batch still in flight (pipeline stages): its next token is not known yet
            num_new = 0 if request.request_id in self.in_flight else \
                self._num_tokens_to_schedule(request, request.num_computed_tokens, plan)
            if num_new == 0:  # a prompt chunk over the attention budget: it goes on next step
                index += 1
                continue
            drafts = self._drafts_to_verify(request, num_new, plan)
            new_blocks = self._allocate_or_preempt(request, num_new + len(drafts), plan)
            if new_blocks is None:  # the request preempted itself
                break
            self._add_to_batch(request, num_new + len(drafts), new_blocks, plan)
            if drafts:
                plan.output.scheduled_spec_decode_tokens[request.request_id] = drafts
            index += 1

    def _drafts_to_verify(self, request: Request, num_new: int, plan: _StepPlan) -> list[int]:
        """The request's draft tokens this step verifies: none unless it decodes (lacks only its newest token);
        at most what the budget left, max_tokens and max_model_len allow (a draft that is accepted becomes an
        output token, and one more is sampled after the last)."""
        if not request.spec_token_ids or request.num_computed_tokens + num_new != request.num_tokens or num_new != 1:
            return []
        room = min(plan.token_budget - num_new, request.max_tokens - request.num_output_tokens - 1,
                   self.config.max_model_len - request.num_tokens)
        return request.spec_token_ids[:max(room, 0)]

    @property
    def _attention_limit(self) -> int:
        """max_num_batched_attention, or a bound no step reaches when it is unset (the positions are still counted:
        max_step_attended_positions)."""
        limit = self.config.max_num_batched_attention
        return UNBOUNDED_ATTENTION if limit is None else limit

    def _num_tokens_to_schedule(self, request: Request, num_computed: int, plan: _StepPlan) -> int:
        """The tokens the request lacks after ``num_computed``, as many as the step's budgets leave.

        A prompt chunk gets what keeps the step's attended positions within the attention budget (the step's
        first chunk at least a block); a decode token (all a request lacks) and a pooled input (never chunked)
        are not held back by it. 0: this chunk waits for the next step."""
        lacking = request.num_tokens - num_computed
        num_new = min(lacking, plan.token_budget)
        if lacking <= 1 or request.pooling_params is not None:
            return num_new
        fits = num_new if self.config.max_num_batched_attention is None else \
            self._max_chunk(num_computed, num_new, plan.attention_budget)
        plan.shrunk_by_time = False
        if plan.prefill_budget is not None:
            timed = self._max_chunk(num_computed, fits, plan.attention_budget, plan.prefill_budget)
            plan.shrunk_by_time, fits = timed < fits, timed
        floor = 0 if plan.has_prompt_chunk else min(num_new, self.block_size)
        plan.floored |= floor > fits
        return max(fits, floor)

    @staticmethod
    def _decodes(request: Request) -> bool:
        """The request lacks only its newest token (a decode; drafts ride along) and is not a pooled input."""
        return request.num_tokens - request.num_computed_tokens == 1 and request.pooling_params is None

    def _max_chunk(self, start: int, limit: int, budget: int, cost: float | None = None) -> int:
        """The most tokens (at most ``limit``) from position ``start`` attending at most ``budget`` positions
        (and, given ``cost``, costing at most that: StepTimeModel.cost)."""
        low, high = 0, limit  # binary search: attended positions and the cost grow with the chunk
        while low < high:
            mid = (low + high + 1) // 2
            if attended_positions(start, mid, self.sliding_window) <= budget and (
                    cost is None or self.step_time.cost(start, mid, self.sliding_window) <= cost):
                low = mid
            else:
                high = mid - 1
        return low

    def _lookahead(self, request: Request, num_new: int) -> int:
        """Slots past the scheduled tokens a draft model writes into, within the request's checked length."""
        if not self.num_lookahead_tokens:
            return 0
        end = request.num_computed_tokens + num_new
        return max(0, min(self.num_lookahead_tokens, request.num_prompt_tokens + request.max_tokens - end))

    def _allocate_or_preempt(self, request: Request, num_new: int, plan: _StepPlan) -> list[KVCacheBlock] | None:
        """Allocate slots, preempting the newest running requests until it fits (or is itself preempted)."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new,
                                                              num_lookahead_tokens=self._lookahead(request, num_new))
            if new_blocks is not None:
                return new_blocks
            # the newest request not in a batch in flight (whose blocks are being written): ``request`` at worst
            victim = next(r for r in reversed(self.running) if r.request_id not in self.in_flight)
            self.running.remove(victim)
            self._preempt(victim, plan)
            if victim is request:
                return None

    def _num_seq_slots_taken(self) -> int:
        """Running requests plus the samples running leaders will fork (their slots are promised)."""
        promised = sum(len(samples) for leader_id, samples in self.pending_forks.items()
                       if self.requests[leader_id].status == RequestStatus.RUNNING)
        return len(self.running) + promised

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        skipped: list[Request] = []  # their adapter would exceed max_loras: they keep their place
        loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        while self.waiting and plan.token_budget > 0 and plan.seq_budget > 0:
            request = self.waiting[0]
            lora = request.lora_request
            # an adapter that would exceed max_loras waits; once one waits, no other adapter's request passes it
            # (a busy adapter could otherwise keep its slot forever): only base-model requests go on
            if lora is not None and (skipped or (lora.lora_int_id not in loras
                                                 and len(loras) >= (self.config.max_loras or 0))):
                skipped.append(self.waiting.popleft())
                continue
            group = 1 + len(self.pending_forks.get(request.request_id, ()))
            if self._num_seq_slots_taken() + group > self.config.max_num_seqs:
                break
            swapped = self.kv_cache_manager.is_swapped(request.request_id)
            admitted = self._swap_in(request, plan) if swapped else self._admit(request, plan)
            if admitted is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if lora is not None:
                loras.add(lora.lora_int_id)
            self._add_to_batch(request, *admitted, plan)
        self.waiting.extendleft(reversed(skipped))

    def _admit(self, request: Request, plan: _StepPlan) -> tuple[int, list[KVCacheBlock]] | None:
        """Allocate a waiting request's slots, starting after its longest cached prefix.

        Returns the tokens to schedule and the newly taken blocks, or None if the pool is short.
        """
        kv = self.kv_cache_manager
        if request.pooling_params is not None:  # every token's hidden state is pooled: all computed, in one step
            if request.num_tokens > plan.token_budget:
                return None
            if not self.needs_kv_cache:  # an encoder: no blocks at all
                request.num_computed_tokens = request.num_cached_tokens = 0
                return request.num_tokens, []
        hits, num_hit = kv.get_computed_blocks(request)
        if request.prompt_logprobs is not None or request.prompt_id_scores is not None \
                or request.pooling_params is not None:  # every token computed
            hits, num_hit = [], 0
        num_new = self._num_tokens_to_schedule(request, num_hit, plan)
        if num_new == 0:  # over the attention budget: admission stops here this step
            return None
        lookahead = self._lookahead(request, num_hit + num_new - request.num_computed_tokens)
        new_blocks = kv.allocate_slots(request, num_new, hits, num_lookahead_tokens=lookahead)
        if new_blocks is None:
            return None
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
        self.stats.prefix_cache_queries += request.num_tokens
        self.stats.prefix_cache_hits += num_hit
        return num_new, new_blocks

    def _swap_in(self, request: Request, plan: _StepPlan) -> tuple[int, list[KVCacheBlock]] | None:
        """Bring a swapped-out request's K/V back, with room for its next tokens.

        Returns the tokens to schedule and the newly taken blocks, or None if the pool is short.
        """
        num_new = self._num_tokens_to_schedule(request, request.num_computed_tokens, plan)
        if num_new == 0:  # over the attention budget: it comes back next step
            return None
        mapping = self.kv_cache_manager.swap_in(request, num_new)
        if mapping is None:
            return None
        new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
        assert new_blocks is not None, "swap_in checked room for the new tokens"
        plan.output.blocks_to_swap_in += mapping
        self.stats.num_swapped_in += 1
        return num_new, new_blocks

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        """Free the request's device blocks and put it back at the queue's front.

        Swap mode moves its K/V to the host pool (it resumes where it was); recompute mode, or
        a full host pool, forgets the K/V (it recomputes them on resumption).
        """
        mapping = self.kv_cache_manager.swap_out(request) if self.config.preemption_mode == "swap" else None
        if mapping is not None:
            plan.output.blocks_to_swap_out += mapping
            self.stats.num_swapped_out += 1
        else:
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        plan.preempted = True
        plan.output.preempted_req_ids.add(request.request_id)
        self.stats.num_preemptions += 1

    def _fork_samples(self, plan: _StepPlan) -> None:
        """The other samples of each leader whose prompt completes now start on its blocks."""
        for leader in plan.forking_leaders:
            num_computed = leader.num_computed_tokens + plan.output.num_scheduled_tokens[leader.request_id]
            for sample in self.pending_forks.pop(leader.request_id):
                del self._leader_of[sample.request_id]
                self.kv_cache_manager.fork(leader, sample)
                sample.num_computed_tokens = num_computed
                sample.status = RequestStatus.RUNNING
                sample.first_scheduled_time = plan.now
                self.running.append(sample)
                self._seen_by_workers.add(sample.request_id)
                plan.output.forked_reqs.append(ForkedRequestData(
                    req_id=sample.request_id, parent_id=leader.request_id, sampling_params=sample.sampling_params,
                    block_ids=self.kv_cache_manager.get_block_ids(sample.request_id),
                    num_computed_tokens=num_computed))
                self.stats.num_forks += 1

    def _add_to_batch(self, request: Request, num_new: int, new_blocks: list[KVCacheBlock], plan: _StepPlan) -> None:
        """Put ``num_new`` tokens of the request (already within the budgets) in the step's batch."""
        out = plan.output
        req_id = request.request_id
        if request.first_scheduled_time is None:
            request.first_scheduled_time = plan.now
        if req_id not in self._seen_by_workers:
            self._seen_by_workers.add(req_id)
            self.kv_cache_manager.take_replaced_table(req_id)  # the workers get the whole table anyway
            out.scheduled_new_reqs.append(self._new_request_data(request))
        else:
            out.scheduled_cached_reqs.append(self._cached_request_data(request, new_blocks))
        out.num_scheduled_tokens[req_id] = num_new
        plan.token_budget -= num_new
        plan.seq_budget -= 1
        plan.attention_budget -= attended_positions(request.num_computed_tokens, num_new, self.sliding_window)
        if request.num_tokens - request.num_computed_tokens > 1:  # a prompt chunk (or a preempted one's recompute)
            plan.has_prompt_chunk = True
            cost = self.step_time.cost(request.num_computed_tokens, num_new, self.sliding_window)
            plan.prefill_tokens += num_new
            plan.prefill_pairs += attended_positions(request.num_computed_tokens, num_new, self.sliding_window)
            plan.prefill_cost += cost
            if plan.prefill_budget is not None:
                plan.prefill_budget -= cost
                self.stats.num_step_time_shrunk_chunks += plan.shrunk_by_time
        elif request.pooling_params is None:
            plan.decodes = True
        if request.num_computed_tokens + num_new < request.num_tokens:
            self.stats.num_chunked_prefills += 1
        elif req_id in self.pending_forks:
            plan.forking_leaders.append(request)

    def _new_request_data(self, request: Request) -> NewRequestData:
        """Everything a worker needs to start tracking ``request``."""
        return NewRequestData(
            req_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens, output_token_ids=request.output_token_ids,
            lora_request=request.lora_request, pooling_params=request.pooling_params,
            token_type_ids=request.token_type_ids, prompt_embeds=request.prompt_embeds)

    def _cached_request_data(self, request: Request, new_blocks: list[KVCacheBlock]) -> CachedRequestData:
        """A known request's new blocks, or its whole table when the table changed in place."""
        kv = self.kv_cache_manager
        replace = kv.take_replaced_table(request.request_id)
        block_ids = kv.get_block_ids(request.request_id) if replace else [b.block_id for b in new_blocks]
        return CachedRequestData(req_id=request.request_id, new_block_ids=block_ids,
                                 num_computed_tokens=request.num_computed_tokens, replace_table=replace)

    def _record_estimate(self, plan: _StepPlan) -> None:
        """With step_time_target: the step's estimated time, and the largest a budgeted prefill step had."""
        estimate = self.step_time.estimate(plan.prefill_cost, plan.decodes)
        self.stats.last_step_estimated_s = estimate
        if plan.prefill_budget is not None and plan.prefill_tokens and not plan.floored:
            self.stats.max_step_estimated_s = max(self.stats.max_step_estimated_s, estimate)
            if self.step_time.measured:  # before, the budget was a chunk's units, not seconds
                self.stats.max_step_estimated_fraction = max(self.stats.max_step_estimated_fraction,
                                                             estimate / plan.allowed_s)

    def _update_after_schedule(self, plan: _StepPlan) -> None:
        out = plan.output
        self._verifying = {req_id: len(drafts) for req_id, drafts in out.scheduled_spec_decode_tokens.items()}
        for req_id, num_new in out.num_scheduled_tokens.items():
            request = self.requests[req_id]
            self.stats.num_prompt_tokens_computed += max(
                0, min(request.num_prompt_tokens, request.num_computed_tokens + num_new) - request.num_computed_tokens)
            request.num_computed_tokens += num_new
        self.stats.num_steps += 1 if out.num_scheduled_tokens else 0
        attended = self._attention_limit - plan.attention_budget
        self.stats.max_step_attended_positions = max(self.stats.max_step_attended_positions, attended)
        self._last_step = (plan.prefill_tokens, plan.prefill_pairs, plan.decodes)
        if self.config.step_time_target is not None and out.num_scheduled_tokens:
            self._record_estimate(plan)
        self.stats.max_num_running = max(self.stats.max_num_running, len(self.running))
        self._refresh_gauges()

    # ------------------------------------------------------------------------- update
    def record_step_time(self, seconds: float) -> None:
        """The wall time of the step last scheduled (executed and updated): teaches the step-time model."""
        self.step_time.observe(*self._last_step, seconds)
        self._last_step = (0, 0, False)  # one measurement per step
        self.stats.step_time_decode_s = self.step_time.decode_s or 0.0
        self.stats.step_time_token_s = self.step_time.token_s()
        self.stats.step_time_pair_s = self.step_time.pair_s()

    def update_from_output(self, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests; each kind of result its own
        part: requests failed alone, pooled vectors, prompt logprobs, sampled tokens (and drafts).

        A finished request's blocks are free at once; the workers learn that it finished from the
        next schedule()'s ``finished_req_ids``.
        """
        results = [self._fail(req_id, why) for req_id, why in runner_output.failed.items() if req_id in self.requests]
        results += self._update_pooled(runner_output.pooler_output)
        self._update_prompt_logprobs(runner_output.prompt_logprobs)
        self._update_prompt_id_scores(runner_output.prompt_id_scores)
        self.in_flight.answered({r: t for r, t in zip(runner_output.req_ids, runner_output.sampled_token_ids) if t})
        for req_id, token_ids, logprobs in zip(runner_output.req_ids, runner_output.sampled_token_ids,
                                               runner_output.logprobs):
            request = self.requests.get(req_id)
            if request is not None and token_ids:  # (else aborted meanwhile, or a prompt chunk)
                results.append(self._update_sampled(request, token_ids, logprobs, runner_output.spec_token_ids))
        self._verifying = {}
        self._refresh_gauges()
        return results

    def _update_pooled(self, vectors: dict[str, Any]) -> list[EngineCoreOutput]:
        """Pooling requests finish with their vector."""
        results = []
        for req_id, vector in vectors.items():
            request = self.requests.get(req_id)
            if request is None:  # aborted meanwhile
                continue
            request.status = RequestStatus.FINISHED_STOPPED
            results.append(EngineCoreOutput(request_id=req_id, new_token_ids=[], finish_reason="stop",
                                            first_scheduled_time=request.first_scheduled_time, pooling_output=vector))
            self.running.remove(request)
            self._free_request(request)
        return results

    def _update_prompt_logprobs(self, found: dict[str, tuple[int, list[TokenLogprobs]]]) -> None:
        """Prompt logprobs a step's chunk scored, put in place (sent with the request's first output)."""
        for req_id, (start, entries) in found.items():
            request = self.requests.get(req_id)
            if request is not None and request.prompt_logprobs is not None:  # a recompute scores them again
                request.prompt_logprobs[start - 1:start - 1 + len(entries)] = entries

    def _update_prompt_id_scores(self, found: dict[str, tuple[int, list[list[float]]]]) -> None:
        """prompt_logprob_token_ids' scores a step's chunk made, put in place by scored row."""
        for req_id, (first_row, rows) in found.items():
            request = self.requests.get(req_id)
            if request is not None and request.prompt_id_scores is not None:
                request.prompt_id_scores[first_row:first_row + len(rows)] = rows

    def _update_sampled(self, request: Request, token_ids: list[int], logprobs: list[TokenLogprobs] | None,
                        drafts: dict[str, list[int]]) -> EngineCoreOutput:
        """A request's new tokens (a verified run of drafts and one more, with speculation) appended up to its stop;
        it finishes there or keeps its next drafts."""
        req_id = request.request_id
        if req_id in self._verifying:
            self._take_back_rejected(request, self._verifying[req_id], len(token_ids) - 1)
        new_tokens = self._append_until_stop(request, token_ids)
        result = _sampled_output(request, new_tokens, [] if logprobs is None else logprobs[:len(new_tokens)])
        if request.is_finished:
            self.running.remove(request)
            self._free_request(request)
        elif drafts or req_id in self._verifying:
            request.spec_token_ids = drafts.get(req_id, [])
            self.kv_cache_manager.trim(request, request.num_tokens + len(request.spec_token_ids))
        return result

    def _append_until_stop(self, request: Request, token_ids: list[int]) -> list[int]:
        """Append ``token_ids`` to the request's output up to the first that stops it; the tokens appended."""
        for n, token_id in enumerate(token_ids, 1):
            request.append_output_token(token_id)
            self.stats.num_generated_tokens += 1
            if self._check_stop(request, token_id):
                return token_ids[:n]
        return list(token_ids)

    def _take_back_rejected(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """The step verified ``num_drafts`` drafts and kept ``num_accepted``: the rejected ones' slots are no
        longer computed tokens (their K/V are overwritten later)."""
        assert 0 <= num_accepted <= num_drafts, (num_accepted, num_drafts)
        request.num_computed_tokens -= num_drafts - num_accepted
        stats = self.stats
        stats.spec_decode_num_drafts += 1
        stats.spec_decode_num_draft_tokens += num_drafts
        stats.spec_decode_num_accepted_tokens += num_accepted
        per_pos = stats.spec_decode_num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_drafts - len(per_pos)))
        for pos in range(num_accepted):
            per_pos[pos] += 1

    def _fail(self, req_id: str, why: str) -> EngineCoreOutput:
        """Finish one request whose own handling failed (finish_reason "error"); its blocks are free at once."""
        request = self.requests[req_id]
        self.finish_requests([req_id], RequestStatus.FINISHED_ERROR)
        return EngineCoreOutput(request_id=req_id, new_token_ids=[], new_logprobs=[], finish_reason="error",
                                stop_reason=None, first_scheduled_time=request.first_scheduled_time,
                                num_cached_tokens=max(request.num_cached_tokens, 0), error=why)

    def _check_stop(self, request: Request, token_id: int) -> bool:
        params = request.sampling_params
        min_reached = request.num_output_tokens >= params.min_tokens
        if min_reached and not params.ignore_eos and token_id in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
        elif min_reached and token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token_id
        elif (request.num_output_tokens >= request.max_tokens
              or request.num_tokens >= self.config.max_model_len):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return request.is_finished

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.kv_cache_manager.free_host(request)
        for orphan in self.pending_forks.pop(request.request_id, []):  # leader gone first: samples run alone
            del self._leader_of[orphan.request_id]
            self.waiting.appendleft(orphan)
        del self.requests[request.request_id]
        self.in_flight.finished([request.request_id])
        if request.request_id in self._seen_by_workers:
            self._seen_by_workers.discard(request.request_id)
            self._finished_since_last_step.add(request.request_id)

    def _refresh_gauges(self) -> None:
        stats = self.stats
        stats.num_running = len(self.running)
        stats.num_waiting = len(self.waiting)
        stats.kv_cache_usage = self.kv_cache_manager.usage()
        stats.max_kv_cache_usage = max(stats.max_kv_cache_usage, stats.kv_cache_usage)


def _sampled_output(request: Request, new_tokens: list[int], logprobs: list[TokenLogprobs]) -> EngineCoreOutput:
    """A sampling request's output of a step: its new tokens (and their logprobs), its finish if it finished, its
    prompt logprobs with its first output."""
    prompt_logprobs = id_scores = None
    if not request.prompt_logprobs_sent:
        prompt_logprobs, id_scores = request.prompt_logprobs, request.prompt_id_scores
        request.prompt_logprobs_sent = True
    return EngineCoreOutput(
        request_id=request.request_id, new_token_ids=new_tokens, new_logprobs=logprobs,
        finish_reason=request.status.finish_reason, stop_reason=request.stop_reason,
        first_scheduled_time=request.first_scheduled_time, num_cached_tokens=max(request.num_cached_tokens, 0),
        prompt_logprobs=prompt_logprobs, prompt_token_id_logprobs=id_scores)
