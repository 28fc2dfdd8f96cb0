"""The attention budget (max_num_batched_attention): late chunks of a long prompt shrink, decodes never wait."""
import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.scheduler import Scheduler, attended_positions
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.errors import ValidationError
from tests.core.utils import fake_runner_output, make_request, make_scheduler


def step(scheduler: Scheduler) -> SchedulerOutput:
    """schedule -> fake model -> update; the schedule."""
    out = scheduler.schedule()
    scheduler.update_from_output(fake_runner_output(scheduler, out))
    assert scheduler.kv_cache_manager.check_integrity()
    return out


def attended(scheduler: Scheduler, out: SchedulerOutput) -> int:
    """Query x key positions the step just scheduled attends (num_computed_tokens already counts it)."""
    return sum(attended_positions(scheduler.requests[r].num_computed_tokens - n, n) if r in scheduler.requests
               else 0 for r, n in out.num_scheduled_tokens.items())


def test_attended_positions_causal_and_sliding_window() -> None:
    assert attended_positions(0, 4) == 1 + 2 + 3 + 4
    assert attended_positions(10, 3) == 11 + 12 + 13
    assert attended_positions(2, 6, window=5) == 3 + 4 + 5 + 5 + 5 + 5
    assert attended_positions(8, 4, window=6) == 4 * 6


def test_late_chunks_of_a_long_prompt_shrink_and_decodes_run_every_step() -> None:
    s = make_scheduler(num_kv_blocks=160, block_size=4, max_num_batched_tokens=64, max_num_batched_attention=64 * 64)
    s.add_request(make_request("d", 3, max_tokens=200))
    assert step(s).num_scheduled_tokens == {"d": 3}
    s.add_request(make_request("long", 400, max_tokens=1))
    chunks = []
    while "long" in s.requests:
        before = s.requests["long"].num_computed_tokens
        out = step(s)
        assert out.num_scheduled_tokens["d"] == 1  # the decode runs every step, beside every chunk
        chunks.append(out.num_scheduled_tokens["long"])
        if "long" in s.requests:
            assert attended(s, out) <= 64 * 64
            assert s.requests["long"].num_computed_tokens == before + chunks[-1]
    # the first chunk is not cut (the token budget, less d's token, is); each later one attends more keys per
    # query, so it gets fewer: 63 * 63 + 47 * 48 / 2 = 4,089 positions (+ d's 5) fit 4,096, 48 tokens would not
    assert chunks[:3] == [63, 47, 32]
    assert chunks == sorted(chunks, reverse=True) and sum(chunks) == 400 and len(chunks) == 21
    assert s.stats.max_step_attended_positions <= 64 * 64
    assert s.stats.num_chunked_prefills == 20


def test_a_prompt_always_progresses_by_a_block_and_decodes_are_never_held_back() -> None:
    s = make_scheduler(num_kv_blocks=32, block_size=4, max_num_batched_tokens=64, max_num_batched_attention=10)
    s.add_request(make_request("a", 20, max_tokens=4))
    s.add_request(make_request("b", 20, max_tokens=4))
    # a's chunk fits 10 positions at 4 tokens (1 + 2 + 3 + 4); at position 4 only 1 token would (5), but the
    # step's first prompt chunk gets a whole block; b, a second chunk over the budget, waits
    for _ in range(5):
        assert step(s).num_scheduled_tokens == {"a": 4}
    # a decodes at position 20 (21 positions: over the budget alone, never held back); b's first chunk gets a block
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 4}
    # the floor goes past the budget by at most a block's positions: the most was a's last chunk, at position 16
    assert s.stats.max_step_attended_positions == attended_positions(16, 4) == 74


@pytest.mark.parametrize("value", [0, -5, True, "4096", 1.5])
def test_max_num_batched_attention_must_be_a_positive_integer(value: object) -> None:
    with pytest.raises(ValidationError) as e:
        SchedulerConfig(max_num_batched_attention=value)
    assert e.value.param == "max_num_batched_attention"


def test_unset_the_attention_budget_cuts_nothing() -> None:
    """The default (None, as vLLM): a long prompt runs in full token-budget chunks; the positions are still
    counted in the stats."""
    s = make_scheduler(num_kv_blocks=160, block_size=4, max_num_batched_tokens=64)
    assert s.config.max_num_batched_attention is None
    s.add_request(make_request("long", 400, max_tokens=1))
    chunks = []
    while "long" in s.requests:
        chunks.append(step(s).num_scheduled_tokens.get("long", 0))
    assert chunks == [64] * 6 + [16] and s.stats.max_step_attended_positions == attended_positions(320, 64)
