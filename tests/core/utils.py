"""Factories for the core tests: a scheduler over a small pool, requests, and the one fake model runner.

Plain functions (imported as ``from tests.core.utils import ...``): the tests call them with
different arguments, which fixtures would only hide.
"""
from __future__ import annotations

from collections.abc import Callable

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

EOS = 0
TOKEN = 7
"""What the fake model runner samples unless told otherwise (never EOS)."""


def make_scheduler(num_kv_blocks: int = 32, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, max_model_len: int = 1024, *,
                   enable_prefix_caching: bool = False, preemption_mode: str = "recompute",
                   num_host_blocks: int = 0, max_num_batched_attention: int | None = None,
                   step_time_target: float | None = None,
                   step_cost_weights: tuple[float, float] = (1.0, 1.0),
                   batches_in_flight: int | None = None) -> Scheduler:
    """A scheduler over a small pool (prefix caching off unless asked for; ``batches_in_flight``: pipeline
    stages')."""
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     max_model_len=max_model_len, preemption_mode=preemption_mode,
                                     max_num_batched_attention=max_num_batched_attention,
                                     step_time_target=step_time_target),
                     CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
                     num_kv_blocks=num_kv_blocks, num_host_blocks=num_host_blocks, step_cost_weights=step_cost_weights,
                     batches_in_flight=batches_in_flight)


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int = 16, **params: object) -> Request:
    """A request with prompt tokens 1..n (never EOS); ``params`` go to its SamplingParams."""
    return Request(request_id, list(range(1, num_prompt_tokens + 1)),
                   SamplingParams(max_tokens=max_tokens, **params), EOS, max_tokens)


def fake_runner_output(scheduler: Scheduler, out: SchedulerOutput,
                       sample: Callable[[str], int] = lambda req_id: TOKEN) -> ModelRunnerOutput:
    """What a model runner returns for ``out``, without a model.

    A token, ``sample(req_id)``, for each scheduled request whose K/V catch up with its tokens
    this step and for each sample forked this step; nothing for a prompt chunk. Call it after
    schedule() and before update_from_output(), as the engine runs its workers.
    """
    req_ids = list(out.num_scheduled_tokens) + [fork.req_id for fork in out.forked_reqs]
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        caught_up = request.num_computed_tokens == request.num_tokens
        sampled.append([sample(req_id)] if caught_up else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=[None] * len(req_ids))
