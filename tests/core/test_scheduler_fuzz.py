"""Seeded fuzz of schedule -> fake model -> update with a small pool, checking invariants every step."""
import random

import pytest

from pagedllm.core.kv_cache_manager import cdiv
from pagedllm.core.scheduler import attended_positions
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.errors import ValidationError
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams
from tests.core.utils import EOS, fake_runner_output, make_scheduler

NUM_KV_BLOCKS = 64
MAX_NUM_SEQS = 8
MAX_NUM_BATCHED_TOKENS = 48
NUM_STEPS = 5000
STEP_TIME_TARGET = 0.05


class Fuzzer:
    """Drives one scheduler with random arrivals, aborts and EOS, and checks it after each step."""

    def __init__(self, seed: int, block_size: int, sharing: bool = False, timed: bool = False) -> None:
        self.rng = random.Random(seed)
        self.block_size = block_size
        self.sharing = sharing
        """Prefix caching, shared prompt prefixes, n>1 samples that fork, and swap preemption."""
        self.prefixes = [[self.rng.randint(1, 999) for _ in range(n)] for n in (0, 20, 40, 70)]
        self.scheduler = make_scheduler(
            NUM_KV_BLOCKS, block_size, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, max_model_len=4096,
            enable_prefix_caching=sharing, preemption_mode="swap" if sharing else "recompute",
            num_host_blocks=24 if sharing else 0, step_time_target=STEP_TIME_TARGET if timed else None,
            max_num_batched_attention=MAX_NUM_BATCHED_TOKENS ** 2)
        self.timed = timed
        """step_time_target on: each step is 'measured' as a noisy linear function of its work."""
        self.next_id = 0
        self.seen_by_workers: set[str] = set()
        self.worker_tables: dict[str, list[int]] = {}
        """Block tables as a worker rebuilds them from the scheduler outputs alone."""
        self.num_finished = 0
        self.all_requests: dict[str, Request] = {}

    def arrive(self) -> None:
        """Add a random request; one that cannot fit the pool must be refused, and only that one."""
        rng = self.rng
        prompt_len, max_tokens = rng.randint(1, 200), rng.randint(1, 100)
        params = SamplingParams(max_tokens=max_tokens, min_tokens=rng.choice([0, 0, 0, min(3, max_tokens)]))
        prompt = [rng.randint(1, 999) for _ in range(prompt_len)]
        n = 1
        if self.sharing:
            prompt = (rng.choice(self.prefixes) + prompt)[:200]
            prompt_len = len(prompt)
            n = rng.choice([1, 1, 2, 3])
        reqs = [Request(f"r{self.next_id}.{i}", prompt, params, EOS, max_tokens) for i in range(n)]
        self.next_id += 1
        req = reqs[0]
        for r in reqs:
            self.all_requests[r.request_id] = r
        fits = cdiv(prompt_len + max_tokens, self.block_size) <= NUM_KV_BLOCKS - 1
        if fits:
            self.scheduler.add_request(req, reqs[1:])
        else:
            with pytest.raises(ValidationError):
                self.scheduler.add_request(req)
            assert req.request_id not in self.scheduler.requests

    def abort_one(self) -> None:
        """Abort a random unfinished request (running or waiting)."""
        if self.scheduler.requests:
            req_id = self.rng.choice(sorted(self.scheduler.requests))
            self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
            assert self.scheduler.kv_cache_manager.get_block_ids(req_id) == []

    def sample(self, req_id: str) -> int:
        """The fake model's token: EOS with 5% chance, else a random one."""
        return EOS if self.rng.random() < 0.05 else self.rng.randint(1, 999)

    def step(self, arrivals: bool) -> None:
        """One engine step with random events around it, then the invariant checks."""
        rng = self.rng
        if arrivals:
            for _ in range(rng.choice([0, 0, 0, 0, 0, 1, 1, 2])):
                if len(self.scheduler.waiting) < 2 * MAX_NUM_SEQS:  # keep the load bounded, not endless
                    self.arrive()
            if rng.random() < 0.03:
                self.abort_one()
        prefill_budget = self.scheduler.step_time.prefill_budget(STEP_TIME_TARGET)  # what the step may take
        out = self.scheduler.schedule()
        self.check_schedule(out)
        if self.timed:
            self.check_step_time(out, prefill_budget)
        runner_output = fake_runner_output(self.scheduler, out, self.sample)
        if arrivals and rng.random() < 0.02:
            self.abort_one()  # between schedule and update: its token is dropped
        for news in self.scheduler.update_from_output(runner_output):
            self.check_news(news.request_id, news.finish_reason)
        if self.timed:  # 1 ms a step, 2 ms per decode, 50 us per prefill unit, +-30%
            s, work = self.scheduler, 0.0
            for req_id, n in out.num_scheduled_tokens.items():
                req = s.requests.get(req_id) or self.all_requests[req_id]
                start = req.num_computed_tokens - n
                work += 0.002 if n == 1 else 5e-5 * s.step_time.units(max(start, 0), n)
            s.record_step_time((0.001 + work) * rng.uniform(0.7, 1.3))
        self.check_state()

    def check_schedule(self, out: SchedulerOutput) -> None:
        """The step's batch respects the budget, the queues, and what the workers know."""
        s = self.scheduler
        assert 0 <= out.total_num_scheduled_tokens <= MAX_NUM_BATCHED_TOKENS
        assert all(n > 0 for n in out.num_scheduled_tokens.values())
        assert out.finished_req_ids <= self.seen_by_workers and not out.finished_req_ids & set(s.requests)
        self.seen_by_workers -= out.finished_req_ids
        assert not (out.preempted_req_ids and out.scheduled_new_reqs), "admission in a preempting step"
        new_ids = {r.req_id for r in out.scheduled_new_reqs}
        cached_ids = {r.req_id for r in out.scheduled_cached_reqs}
        forked_ids = {r.req_id for r in out.forked_reqs}
        assert not new_ids & self.seen_by_workers and cached_ids <= self.seen_by_workers
        assert not forked_ids & (self.seen_by_workers | new_ids | cached_ids)
        self.seen_by_workers |= new_ids | forked_ids
        assert new_ids | cached_ids == set(out.num_scheduled_tokens)
        for req_id in out.finished_req_ids:
            del self.worker_tables[req_id]
        for new in out.scheduled_new_reqs:
            self.worker_tables[new.req_id] = list(new.block_ids)
        for cached in out.scheduled_cached_reqs:
            old = [] if cached.replace_table else self.worker_tables[cached.req_id]
            self.worker_tables[cached.req_id] = old + cached.new_block_ids
        for fork in out.forked_reqs:
            assert fork.parent_id in out.num_scheduled_tokens
            self.worker_tables[fork.req_id] = list(fork.block_ids)
            assert fork.block_ids == self.worker_tables[fork.parent_id]
        for data in out.scheduled_new_reqs + out.scheduled_cached_reqs:
            req = s.requests[data.req_id]
            assert self.worker_tables[data.req_id] == s.kv_cache_manager.get_block_ids(data.req_id)
            assert data.num_computed_tokens + out.num_scheduled_tokens[data.req_id] == req.num_computed_tokens
        assert all(s.requests[r].status == RequestStatus.RUNNING for r in out.num_scheduled_tokens)
        assert all(s.requests[r].status == RequestStatus.PREEMPTED for r in out.preempted_req_ids)
        budget, first_chunk = s.config.max_num_batched_attention, True
        for req_id, n in out.num_scheduled_tokens.items():  # in scheduling order: each prompt chunk fit what was left
            req = s.requests[req_id]
            start = req.num_computed_tokens - n
            budget -= attended_positions(start, n)
            if req.num_tokens - start > 1:  # a prompt chunk (a decode token is never held back)
                assert budget >= 0 or (first_chunk and n <= self.block_size), (req_id, start, n, budget)
                first_chunk = False

    def check_step_time(self, out: SchedulerOutput, prefill_budget: float) -> None:
        """Beside a decode, each prompt chunk fit the prefill cost left when it was scheduled, or was the step's
        first and at most a block."""
        s = self.scheduler
        chunks = []
        for req_id, n in out.num_scheduled_tokens.items():
            req = s.requests[req_id]
            start = req.num_computed_tokens - n
            chunks.append((start, n, req.num_tokens - start > 1))
        if all(prompt for _, _, prompt in chunks):
            return  # no decode: no step-time cap
        first = True
        for start, n, prompt in chunks:
            if prompt:
                prefill_budget -= s.step_time.cost(start, n)
                assert prefill_budget >= -1e-9 or (first and n <= self.block_size), (start, n, prefill_budget)
                first = False

    def check_news(self, req_id: str, finish_reason: str | None) -> None:
        """A finished request ended for a reason its tokens justify, and left no trace."""
        req = self.all_requests[req_id]
        assert req.num_output_tokens <= req.max_tokens
        if finish_reason is None:
            return
        assert req_id not in self.scheduler.requests and self.scheduler.kv_cache_manager.get_block_ids(req_id) == []
        if finish_reason == "length":
            assert req.num_output_tokens == req.max_tokens
        else:
            assert finish_reason == "stop" and req.output_token_ids[-1] == EOS
            assert req.num_output_tokens >= req.sampling_params.min_tokens
        self.num_finished += 1

    def check_state(self) -> None:
        """Pool accounting, queue membership and block tables after a step."""
        s = self.scheduler
        kv = s.kv_cache_manager
        assert kv.check_integrity()
        tables = kv.req_to_blocks
        used = {b for blocks in tables.values() for b in blocks}
        if not self.sharing:
            assert len(used) == sum(len(blocks) for blocks in tables.values()), "a block in two tables"
        assert kv.num_free_blocks + len(used) == kv.block_pool.num_usable_blocks
        assert len(s.running) <= MAX_NUM_SEQS
        pending = [r for samples in s.pending_forks.values() for r in samples]
        assert sorted(r.request_id for r in s.running + list(s.waiting) + pending) == sorted(s.requests)
        assert set(tables) <= {r.request_id for r in s.running}
        for req in s.running:  # exactly the blocks its computed tokens need
            assert req.status == RequestStatus.RUNNING and req.num_computed_tokens < req.num_tokens
            assert len(kv.get_block_ids(req.request_id)) == cdiv(req.num_computed_tokens, self.block_size)
        for req in s.waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert kv.get_block_ids(req.request_id) == []
            swapped = kv.req_to_host_blocks.get(req.request_id)
            if swapped is None:
                assert req.num_computed_tokens == 0
            else:
                assert len(swapped) == cdiv(req.num_computed_tokens, self.block_size)


@pytest.mark.parametrize("block_size, sharing, timed",
                         [(4, False, False), (16, False, False), (16, True, False), (4, True, False), (16, True, True)])
def test_scheduler_fuzz(block_size: int, sharing: bool, timed: bool) -> None:
    fuzz = Fuzzer(seed=1234 + block_size, block_size=block_size, sharing=sharing, timed=timed)
    for _ in range(NUM_STEPS):
        fuzz.step(arrivals=True)
    s = fuzz.scheduler
    assert s.stats.num_preemptions > 0 and s.stats.num_chunked_prefills > 0
    assert s.stats.max_kv_cache_usage == 1.0 and fuzz.num_finished > 200
    if block_size == 16 and not sharing:  # with 4-token blocks the pool, not max_num_seqs, is the limit
        assert s.stats.max_num_running == MAX_NUM_SEQS
    if sharing:  # every sharing mechanism was exercised
        assert s.stats.prefix_cache_hits > 0 and s.stats.num_forks > 0
        assert s.stats.num_swapped_out > 0 and s.stats.num_swapped_in > 0
    if timed:  # the target shaped steps, from a learned model
        assert s.stats.num_step_time_shrunk_chunks > 0 and s.stats.step_time_decode_s > 0
        assert 0 < s.stats.max_step_estimated_fraction <= 1 + 1e-9

    for _ in range(50_000):  # drain: every request must finish
        if not s.has_unfinished_requests():
            break
        fuzz.step(arrivals=False)
    assert not s.has_unfinished_requests(), f"did not drain: {s.running} {list(s.waiting)}"
    kv = s.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks and kv.req_to_blocks == {}
    assert len(kv.host_free) == kv.num_host_blocks and kv.req_to_host_blocks == {}
    assert s.requests == {} and not s.running and not s.waiting
    assert s.schedule().finished_req_ids == fuzz.seen_by_workers == set(fuzz.worker_tables)  # the last finishes
