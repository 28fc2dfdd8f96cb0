"""The ``paged`` scheme: a trace replayed through the real ``Scheduler`` and a fake model runner."""
from __future__ import annotations

from collections import deque

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.entrypoints.bench.memory_sim.series import PoolLimits, StepSeries
from pagedllm.entrypoints.bench.traces import TraceRequest
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

PAGED = "paged"
"""Name of the scheme in results and tables."""


def make_request(item: TraceRequest, trace_name: str) -> Request:
    """A request whose prompt tokens are unique to it (so prefix caching could never hit)."""
    params = SamplingParams(max_tokens=item.output_len, ignore_eos=True)
    prompt = [item.index + 1] * item.prompt_len
    return Request(f"{trace_name}-{item.index}", prompt, params, eos_token_ids=None,
                   max_tokens=item.output_len, arrival_time=float(item.arrival_step))


def fake_model(scheduler: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
    """Token 1 for each request whose K/V caught up with its tokens; nothing for a prompt chunk."""
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        sampled.append([1] if request.num_computed_tokens == request.num_tokens else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=[None] * len(req_ids))


def sample_paged(scheduler: Scheduler, out: SchedulerOutput, step: int, series: StepSeries) -> None:
    """Record the K/V held (token states) and the slots of blocks in use after ``schedule()``."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    stored = sum(r.num_computed_tokens for r in scheduler.running)
    held = (pool.num_usable_blocks - pool.num_free_blocks) * kv.block_size
    series.add(step, stored, 0, held - stored, 0, len(out.num_scheduled_tokens))


def simulate_paged(trace: list[TraceRequest], limits: PoolLimits, trace_name: str) -> tuple[StepSeries, int]:
    """Replay ``trace`` through the real scheduler; returns the series and the number of preemptions."""
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=limits.max_num_seqs, max_num_batched_tokens=limits.max_num_batched_tokens,
                        max_model_len=limits.max_model_len),
        CacheConfig(block_size=limits.block_size), num_kv_blocks=limits.kv_slots // limits.block_size + 1)
    pending, series, step = deque(trace), StepSeries(), 0
    while pending or scheduler.has_unfinished_requests():
        if not scheduler.has_unfinished_requests():
            step = max(step, pending[0].arrival_step)
        while pending and pending[0].arrival_step <= step:
            scheduler.add_request(make_request(pending.popleft(), trace_name))
        out = scheduler.schedule()
        assert out.num_scheduled_tokens, f"step {step}: nothing scheduled with requests waiting"
        sample_paged(scheduler, out, step, series)
        scheduler.update_from_output(fake_model(scheduler, out))
        step += 1
    return series, scheduler.stats.num_preemptions
