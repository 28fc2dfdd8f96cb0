"""The step-time target (step_time_target): beside decodes, prompt chunks shrink so a step's estimated time (a
model learned from given measurements) stays under the target; without decodes they are whole."""
import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.core.step_time import PRIOR_ATTENTION_RATIO, UNMEASURED_CHUNK_TOKENS, StepTimeModel, cost_weights
from pagedllm.errors import ValidationError
from pagedllm.request import RequestStatus
from tests.core.utils import fake_runner_output, make_request, make_scheduler


def step(scheduler: Scheduler, seconds: float) -> SchedulerOutput:
    """schedule -> fake model -> update, 'measured' at ``seconds``; the schedule."""
    out = scheduler.schedule()
    scheduler.update_from_output(fake_runner_output(scheduler, out))
    scheduler.record_step_time(seconds)
    assert scheduler.kv_cache_manager.check_integrity()
    return out


def test_cost_weights_of_smollm2_135m() -> None:
    token, attention = cost_weights(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                                    num_kv_heads=3, head_dim=64)
    assert token == 2 * 30 * (576 * (2 * 576 + 2 * 192) + 3 * 576 * 1536)  # ~2 x 106M non-embedding weights
    assert attention == 4 * 30 * 9 * 64


def test_the_model_learns_decode_time_and_the_prefill_costs() -> None:
    m = StepTimeModel(token_weight=2.0, attention_weight=1.0)
    assert not m.measured and m.token_s() == 0.0
    assert m.prefill_budget(1.0) == m.units(0, UNMEASURED_CHUNK_TOKENS) == 2.0 * 256 + 256 * 257 / 2
    m.observe(0, 0, True, 0.2)  # a decode-only step
    assert m.decode_s == 0.2
    m.observe(8, 36, True, 5.0)  # too few prompt tokens to teach anything
    assert not m.measured
    # truth: 1 ms per token unit, 2 ms per attention unit; 0.2 s of decodes beside
    truth = lambda tokens, pairs: 0.001 * 2.0 * tokens + 0.002 * pairs  # noqa: E731
    m.observe(100, 0, True, 0.2 + truth(100, 0))
    assert m.measured and m.token_s() == pytest.approx(0.002)
    # one attention share seen: attention assumed PRIOR_ATTENTION_RATIO x as costly per unit
    assert m.cost(0, 10) == pytest.approx(0.001 * 20 + 0.001 * PRIOR_ATTENTION_RATIO * 55)
    assert m.prefill_budget(1.0) == pytest.approx(0.8)
    assert m.estimate(0.5, True) == pytest.approx(0.7) and m.estimate(0.5, False) == pytest.approx(0.5)
    for pairs in (50, 400, 3000):  # shares that differ: the fit finds the truth
        m.observe(100, pairs, False, truth(100, pairs))
    assert m.cost(1000, 50) == pytest.approx(truth(50, 1000 * 50 + 50 * 51 // 2), rel=0.02)
    m.observe(100, 0, True, 0.1)  # faster than its decodes alone (noise): no sample
    assert m.cost(1000, 50) == pytest.approx(truth(50, 1000 * 50 + 50 * 51 // 2), rel=0.02)
    m.observe(0, 0, True, 0.7)  # slower decodes are believed faster (half) than faster ones (a fifth)
    assert m.decode_s == pytest.approx(0.45)
    m.observe(0, 0, True, 0.2)
    assert m.decode_s == pytest.approx(0.4)
    assert m.prefill_budget(0.5) == pytest.approx(0.4)  # max(target - decode, decode)


def scheduler_decoding() -> Scheduler:
    """Tokens cost 1 unit each (no attention weight); a stream 'd' decodes, measured at 0.2 s a step."""
    s = make_scheduler(num_kv_blocks=1200, block_size=4, max_num_batched_tokens=512, max_model_len=8192,
                       max_num_batched_attention=10**9, step_time_target=1.0, step_cost_weights=(1.0, 0.0))
    s.add_request(make_request("d", 3, max_tokens=1000))
    assert step(s, 0.05).num_scheduled_tokens == {"d": 3}
    assert step(s, 0.2).num_scheduled_tokens == {"d": 1}
    assert s.step_time.decode_s == 0.2 and s.stats.step_time_decode_s == 0.2
    return s


def test_beside_decodes_chunks_shrink_to_the_target() -> None:
    s = scheduler_decoding()
    s.add_request(make_request("long", 3000, max_tokens=1))
    # no prefill measured yet: a conservative chunk
    assert step(s, 0.2 + 0.002 * 256).num_scheduled_tokens == {"d": 1, "long": UNMEASURED_CHUNK_TOKENS}
    assert s.step_time.token_s() == pytest.approx(0.002)
    # measured: the prefill takes 1.0 - 0.2 s = 400 tokens at 2 ms; the step is estimated at the target
    out = step(s, 1.0)
    assert out.num_scheduled_tokens["d"] == 1 and 399 <= out.num_scheduled_tokens["long"] <= 400
    assert s.stats.last_step_estimated_s == pytest.approx(1.0, abs=0.003) == s.stats.max_step_estimated_s
    assert s.stats.last_step_estimated_s <= 1.0
    assert s.stats.max_step_estimated_fraction == pytest.approx(1.0, abs=0.003)
    assert s.stats.step_time_token_s == pytest.approx(0.002)
    assert s.stats.num_step_time_shrunk_chunks == 2
    # a heavy decode load: the prefill still gets as long as the decodes (the step at most doubles)
    s.step_time.decode_s = 0.7
    out = step(s, 1.4)
    assert out.num_scheduled_tokens["d"] == 1 and 349 <= out.num_scheduled_tokens["long"] <= 350  # 0.7 s / 2 ms
    assert s.stats.max_step_estimated_fraction <= 1 + 1e-9  # 0.7 + 0.7 of the 1.4 s allowed
    s.step_time.decode_s = 5.0
    assert step(s, 10.0).num_scheduled_tokens == {"d": 1, "long": 511}  # the token budget binds first
    # no decode in the step: no cap, the whole token budget
    s.finish_requests(["d"], RequestStatus.FINISHED_ABORTED)
    assert step(s, 1.0).num_scheduled_tokens == {"long": 512}


def test_attended_positions_count_in_the_units() -> None:
    s = scheduler_decoding()
    s.step_time = StepTimeModel(token_weight=1.0, attention_weight=0.5 / PRIOR_ATTENTION_RATIO, decode_s=0.2)
    s.step_time.observe(100, 0, False, 0.2)  # 2 ms per token unit, 2 x PRIOR_ATTENTION_RATIO per attention unit
    s.add_request(make_request("long", 3000, max_tokens=1))
    # 0.8 s: 2 ms x (c + 0.5 * c (c + 1) / 2) <= 0.8 from position 0 -> 37 tokens (37 + 351.5), 38 would not fit
    assert step(s, 1.0).num_scheduled_tokens == {"d": 1, "long": 37}
    assert s.step_time.cost(0, 37) <= 0.8 < s.step_time.cost(0, 38)


def test_the_first_chunk_gets_a_block_and_later_ones_wait() -> None:
    s = scheduler_decoding()
    s.step_time.observe(100, 0, False, 1000.0)  # 10 s per token: nothing fits 0.8 s
    s.add_request(make_request("a", 50, max_tokens=1))
    s.add_request(make_request("b", 50, max_tokens=1))
    assert step(s, 0.2).num_scheduled_tokens == {"d": 1, "a": 4}
    assert step(s, 0.2).num_scheduled_tokens == {"d": 1, "a": 4}


def test_off_no_cap_beside_decodes() -> None:
    s = make_scheduler(num_kv_blocks=1200, block_size=4, max_num_batched_tokens=512, max_model_len=8192,
                       max_num_batched_attention=10**9)
    s.add_request(make_request("d", 3, max_tokens=1000))
    step(s, 0.05)
    step(s, 0.2)
    s.add_request(make_request("long", 3000, max_tokens=1))
    assert step(s, 5.0).num_scheduled_tokens == {"d": 1, "long": 511}
    assert s.stats.num_step_time_shrunk_chunks == 0 and s.stats.last_step_estimated_s == 0.0


@pytest.mark.parametrize("value", [0, -1.0, True, "1", float("inf"), float("nan")])
def test_step_time_target_must_be_a_positive_number(value: object) -> None:
    with pytest.raises(ValidationError) as e:
        SchedulerConfig(step_time_target=value)
    assert e.value.param == "step_time_target"

