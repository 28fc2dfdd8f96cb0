"""Scheduler driven by a fake model runner: exact queues, token counts and block ids per step."""
import pytest

from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import CachedRequestData, SchedulerOutput
from pagedllm.errors import ValidationError
from pagedllm.outputs import EngineCoreOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams
from tests.core.utils import EOS, TOKEN, fake_runner_output, make_request, make_scheduler


def add(scheduler: Scheduler, request_id: str, num_prompt_tokens: int, max_tokens: int = 16,
        **params: object) -> Request:
    """Queue a request with prompt tokens 1..n (never EOS)."""
    request = make_request(request_id, num_prompt_tokens, max_tokens, **params)
    scheduler.add_request(request)
    return request


def step(scheduler: Scheduler,
         tokens: dict[str, int] | None = None) -> tuple[SchedulerOutput, dict[str, EngineCoreOutput]]:
    """schedule -> fake model (``tokens``: what a request samples, else TOKEN) -> update; the schedule
    and the per-request news."""
    out = scheduler.schedule()
    news = scheduler.update_from_output(fake_runner_output(scheduler, out, lambda r: (tokens or {}).get(r, TOKEN)))
    assert scheduler.kv_cache_manager.check_integrity()
    return out, {n.request_id: n for n in news}


def queues(scheduler: Scheduler) -> tuple[list[str], list[str]]:
    """(running ids, waiting ids) in order."""
    return [r.request_id for r in scheduler.running], [r.request_id for r in scheduler.waiting]


def blocks(scheduler: Scheduler, request_id: str) -> list[int]:
    """The request's block table as physical block ids."""
    return scheduler.kv_cache_manager.get_block_ids(request_id)


def test_fcfs_admission_and_block_growth() -> None:
    s = make_scheduler()
    add(s, "a", 5), add(s, "b", 3), add(s, "c", 9)
    assert queues(s) == ([], ["a", "b", "c"])
    out, news = step(s)
    assert list(out.num_scheduled_tokens.items()) == [("a", 5), ("b", 3), ("c", 9)]
    assert [(n.req_id, n.block_ids, n.num_computed_tokens) for n in out.scheduled_new_reqs] == [
        ("a", [1, 2], 0), ("b", [3], 0), ("c", [4, 5, 6], 0)]
    assert queues(s) == (["a", "b", "c"], [])
    assert {k: n.new_token_ids for k, n in news.items()} == {"a": [TOKEN], "b": [TOKEN], "c": [TOKEN]}

    add(s, "d", 4)  # arrives while the others decode: running ones are scheduled first
    out, _ = step(s)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 1), ("c", 1), ("d", 4)]
    assert out.scheduled_cached_reqs == [
        CachedRequestData(req_id=r, new_block_ids=[], num_computed_tokens=n) for r, n in (("a", 5), ("b", 3), ("c", 9))]
    assert [n.req_id for n in out.scheduled_new_reqs] == ["d"] and blocks(s, "d") == [7]

    out, _ = step(s)  # b (5th token) and d (5th token) open a second block; a and c do not
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1, "d": 1}
    assert [(c.req_id, c.new_block_ids) for c in out.scheduled_cached_reqs] == [
        ("a", []), ("b", [8]), ("c", []), ("d", [9])]
    assert [blocks(s, r) for r in "abcd"] == [[1, 2], [3, 8], [4, 5, 6], [7, 9]]
    assert s.stats.num_preemptions == 0 and s.stats.num_chunked_prefills == 0


def test_waiting_head_blocks_later_arrivals() -> None:
    s = make_scheduler(num_kv_blocks=5)  # 4 usable blocks
    add(s, "a", 8, max_tokens=4)
    step(s)
    add(s, "b", 12, max_tokens=4)  # needs 3 blocks, 2 are free
    add(s, "c", 1, max_tokens=4)  # would fit, but arrived later
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1}
    assert queues(s) == (["a"], ["b", "c"])


def test_chunked_prefill_under_the_token_budget() -> None:
    s = make_scheduler(max_num_batched_tokens=8, max_num_batched_attention=10**6)  # the token budget alone
    add(s, "a", 20)
    out, news = step(s)
    assert out.num_scheduled_tokens == {"a": 8} and blocks(s, "a") == [1, 2] and news == {}
    assert s.stats.num_chunked_prefills == 1
    out, news = step(s)
    assert out.scheduled_cached_reqs == [CachedRequestData(req_id="a", new_block_ids=[3, 4], num_computed_tokens=8)]
    assert news == {}
    assert s.stats.num_chunked_prefills == 2
    add(s, "b", 6)
    out, news = step(s)  # a's last 4 prompt tokens first, then b gets what is left of the budget
    assert list(out.num_scheduled_tokens.items()) == [("a", 4), ("b", 4)]
    assert blocks(s, "a") == [1, 2, 3, 4, 5] and blocks(s, "b") == [6]
    assert list(news) == ["a"] and s.stats.num_chunked_prefills == 3
    out, news = step(s)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 2)]
    assert list(news) == ["a", "b"] and s.stats.num_chunked_prefills == 3


def test_max_num_seqs_limits_running_requests() -> None:
    s = make_scheduler(max_num_seqs=2)
    add(s, "a", 3, max_tokens=1), add(s, "b", 3), add(s, "c", 3)
    out, news = step(s)
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    assert news["a"].finish_reason == "length"  # a's one token was its last
    assert queues(s) == (["b"], ["c"]) and blocks(s, "a") == []
    out, _ = step(s)
    assert list(out.num_scheduled_tokens.items()) == [("b", 1), ("c", 3)]
    assert out.finished_req_ids == {"a"}
    assert queues(s) == (["b", "c"], []) and s.stats.max_num_running == 2


def test_preemption_takes_the_newest_running_request() -> None:
    s = make_scheduler(num_kv_blocks=4)  # 3 usable blocks
    a, b, c = (add(s, r, n, max_tokens=8) for r, n in (("a", 4), ("b", 1), ("c", 1)))
    step(s)
    assert [blocks(s, r) for r in "abc"] == [[1], [2], [3]]
    add(s, "d", 1, max_tokens=8)
    out, _ = step(s)  # a needs a second block: c (newest) is preempted and its block goes to a
    assert out.num_scheduled_tokens == {"a": 1, "b": 1} and out.preempted_req_ids == {"c"}
    assert queues(s) == (["a", "b"], ["c", "d"])
    assert blocks(s, "a") == [1, 3] and blocks(s, "c") == []
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.num_tokens == 2
    assert s.stats.num_preemptions == 1 and a.num_computed_tokens == 5 and b.num_computed_tokens == 2


def test_preempted_request_resumes_with_its_full_block_table() -> None:
    s = make_scheduler(num_kv_blocks=5, max_num_batched_tokens=5)  # 4 usable blocks
    add(s, "a", 4, max_tokens=4)
    b = add(s, "b", 8, max_tokens=8)
    expected = [({"a": 4, "b": 1}, {"a": [1], "b": [2]}),
                ({"a": 1, "b": 4}, {"a": [1, 3], "b": [2, 4]}),
                ({"a": 1, "b": 3}, {"a": [1, 3], "b": [2, 4]})]
    for scheduled, tables in expected:
        out, _ = step(s)
        assert out.num_scheduled_tokens == scheduled and out.preempted_req_ids == set()
        assert {r: blocks(s, r) for r in "ab"} == tables
    assert s.kv_cache_manager.num_free_blocks == 0 and b.num_tokens == 9

    out, news = step(s)  # b's 9th token needs a third block: b preempts itself
    assert out.num_scheduled_tokens == {"a": 1} and out.preempted_req_ids == {"b"}
    assert s.stats.num_preemptions == 1 and b.num_computed_tokens == 0
    # 4 tokens of budget and 2 free blocks are left, yet nobody is admitted in a preempting step.
    assert "b" not in out.num_scheduled_tokens and queues(s) == ([], ["b"])
    assert news["a"].finish_reason == "length"
    assert s.kv_cache_manager.block_pool.free_queue.block_ids() == [4, 2, 3, 1]

    out, news = step(s)
    assert out.finished_req_ids == {"a"} and out.scheduled_new_reqs == []
    assert out.num_scheduled_tokens == {"b": 5}
    assert out.scheduled_cached_reqs == [CachedRequestData(req_id="b", new_block_ids=[4, 2], num_computed_tokens=0,
                                                           replace_table=True)]
    assert queues(s) == (["b"], []) and b.status == RequestStatus.RUNNING and news == {}
    out, news = step(s)
    assert out.scheduled_cached_reqs == [CachedRequestData(req_id="b", new_block_ids=[3], num_computed_tokens=5,
                                                           replace_table=False)]
    assert news["b"].new_token_ids == [TOKEN] and b.output_token_ids == [TOKEN, TOKEN]


def test_abort_frees_blocks_at_once() -> None:
    s = make_scheduler(num_kv_blocks=8)
    add(s, "a", 8), add(s, "b", 4)
    out = s.schedule()
    runner_output = fake_runner_output(s, out)
    add(s, "c", 4)
    s.finish_requests(["a", "c"], RequestStatus.FINISHED_ABORTED)  # a between schedule and update
    assert blocks(s, "a") == [] and s.kv_cache_manager.block_pool.free_queue.block_ids() == [4, 5, 6, 7, 2, 1]
    assert queues(s) == (["b"], []) and set(s.requests) == {"b"}
    news = s.update_from_output(runner_output)
    assert [n.request_id for n in news] == ["b"]
    out, _ = step(s)
    assert out.finished_req_ids == {"a"}  # c was never sent to the workers
    assert out.num_scheduled_tokens == {"b": 1}
    assert s.kv_cache_manager.check_integrity()


def test_stop_on_eos_and_stop_token_ids() -> None:
    s = make_scheduler()
    a, b = add(s, "a", 3), add(s, "b", 3, stop_token_ids=[42])
    _, news = step(s, {"a": EOS, "b": 42})
    assert (news["a"].new_token_ids, news["a"].finish_reason, news["a"].stop_reason) == ([EOS], "stop", None)
    assert (news["b"].new_token_ids, news["b"].finish_reason, news["b"].stop_reason) == ([42], "stop", 42)
    assert a.status == b.status == RequestStatus.FINISHED_STOPPED
    assert s.requests == {} and queues(s) == ([], [])
    assert s.kv_cache_manager.num_free_blocks == 31


def test_min_tokens_suppresses_eos_and_stop_tokens() -> None:
    s = make_scheduler()
    add(s, "a", 3, min_tokens=2), add(s, "b", 3, min_tokens=2, stop_token_ids=[42])
    _, news = step(s, {"a": EOS, "b": 42})
    assert news["a"].finish_reason is None and news["b"].finish_reason is None
    _, news = step(s, {"a": EOS, "b": 42})
    assert news["a"].finish_reason == "stop" and (news["b"].finish_reason, news["b"].stop_reason) == ("stop", 42)


def test_ignore_eos_runs_to_max_tokens() -> None:
    s = make_scheduler()
    req = add(s, "a", 3, max_tokens=3, ignore_eos=True)
    reasons = [step(s, {"a": EOS})[1]["a"].finish_reason for _ in range(3)]
    assert reasons == [None, None, "length"] and req.output_token_ids == [EOS] * 3


def test_max_tokens_and_max_model_len_give_length() -> None:
    s = make_scheduler(max_model_len=6)
    add(s, "a", 2, max_tokens=2), add(s, "b", 4, max_tokens=16)
    _, news = step(s)
    assert news["a"].finish_reason is None and news["b"].finish_reason is None
    _, news = step(s)
    assert news["a"].finish_reason == "length"  # 2 = max_tokens
    assert news["b"].finish_reason == "length"  # 6 tokens = max_model_len
    assert not s.has_unfinished_requests() and s.kv_cache_manager.num_free_blocks == 31


def test_request_larger_than_the_pool_is_refused() -> None:
    s = make_scheduler(num_kv_blocks=5)  # 4 usable blocks of 4 tokens
    with pytest.raises(ValidationError, match="max_tokens") as info:
        add(s, "big", 10, max_tokens=7)  # 17 tokens need 5 blocks
    assert info.value.param == "max_tokens" and info.value.value == 7
    assert s.requests == {} and queues(s) == ([], [])
    assert s.schedule().is_empty
    add(s, "fits", 10, max_tokens=6)  # 16 tokens: exactly the pool
    assert queues(s) == ([], ["fits"])


def test_max_loras_holds_back_a_third_adapter_and_everything_after_it() -> None:
    """max_loras=2: requests of adapters 1 and 2 (and of none) run together; adapter 3's waits, keeps the
    head of the queue, and later requests with an adapter (even a running one) wait behind it, so a busy
    adapter cannot keep a slot forever; base-model requests go on."""
    from pagedllm.config import CacheConfig, SchedulerConfig
    from pagedllm.lora_request import LoRARequest

    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_loras=2),
                  CacheConfig(block_size=4, enable_prefix_caching=False), num_kv_blocks=32)
    lora = {i: LoRARequest(f"a{i}", i, f"/adapters/{i}") for i in (1, 2, 3)}
    for name, adapter, max_tokens in [("r1", 1, 1), ("r2", 2, 4), ("r3", 3, 4), ("r4", None, 4), ("r5", 1, 4)]:
        request = make_request(name, 4, max_tokens)
        request.lora_request = lora[adapter] if adapter else None
        s.add_request(request)
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["r1", "r2", "r4"] and queues(s)[1] == ["r3", "r5"]
    assert [n.lora_request for n in out.scheduled_new_reqs] == [lora[1], lora[2], None]
    out, _ = step(s)  # r1 finished: adapter 3 takes its slot; r5 (adapter 1) now waits for one
    assert [n.req_id for n in out.scheduled_new_reqs] == ["r3"] and queues(s)[1] == ["r5"]
    assert out.scheduled_new_reqs[0].lora_request == lora[3]
    for _ in range(2):
        out, _ = step(s)
        assert "r5" not in out.num_scheduled_tokens  # adapters 2 and 3 still run
    out, _ = step(s)  # r2 sampled its last token in the step before: adapter 1 gets a slot back
    assert [n.req_id for n in out.scheduled_new_reqs] == ["r5"] and out.scheduled_new_reqs[0].lora_request == lora[1]


def test_sliding_window_returns_blocks_before_the_window() -> None:
    """Every layer slides (window 6, blocks of 4): a 48-token request runs in a pool of 5 usable blocks
    (12 without the window), holding at most the window's blocks and one chunk's; the freed blocks are
    null placeholders in the table the workers get whole."""
    from pagedllm.config import CacheConfig, SchedulerConfig

    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8),
                  CacheConfig(block_size=4, enable_prefix_caching=False, sliding_window=6), num_kv_blocks=6)
    request = make_request("a", 8, max_tokens=40)
    s.add_request(request)
    kv = s.kv_cache_manager
    most, nulls_seen = 0, False
    while s.requests:
        out, _ = step(s)
        table = kv.req_to_blocks.get("a", [])
        live = [b for b in table if b is not kv.block_pool.null_block]
        most = max(most, len(live))
        if any(b is kv.block_pool.null_block for b in table):
            nulls_seen = True
            cached = {c.req_id: c for c in out.scheduled_cached_reqs}
            if "a" in cached and cached["a"].replace_table:
                assert 0 in cached["a"].new_block_ids  # the workers see the null block in its place
    assert request.num_output_tokens == 40 and nulls_seen
    assert most <= kv.max_blocks_held(48, 8) == 5
    assert kv.block_pool.num_free_blocks == 5  # everything back


def test_sliding_window_with_swap_and_prefix_caching() -> None:
    """Every layer slides, preemption swaps, prefix caching is on, prompts share a prefix: requests are swapped
    out and back while their early blocks are null placeholders; the null block never enters the prefix cache,
    no swapped-in block is freed and handed out again in the same step, and every block comes back."""
    from pagedllm.config import CacheConfig, SchedulerConfig

    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, preemption_mode="swap"),
                  CacheConfig(block_size=4, enable_prefix_caching=True, sliding_window=6),
                  num_kv_blocks=9, num_host_blocks=12)
    kv = s.kv_cache_manager
    for i in range(4):
        request = Request(f"r{i}", [1, 2, 3, 4, 5, 6, 7, 8] + [20 + i] * (3 + i), SamplingParams(max_tokens=30),
                          EOS, 30)
        s.add_request(request)
    swapped_in = 0
    while s.requests:
        out, _ = step(s)
        targets = [d for _, d in out.blocks_to_swap_in]
        assert len(targets) == len(set(targets)) and 0 not in targets  # no block copied into twice, nor the null one
        swapped_in += len(out.blocks_to_swap_in)
        assert kv.block_pool.null_block.block_hash is None and kv.block_pool.null_block not in \
            kv.block_pool.cached_blocks.values()
    assert s.stats.num_swapped_out > 0 and swapped_in > 0
    assert kv.block_pool.num_free_blocks == 8 and len(kv.host_free) == 12


def test_batches_in_flight_through_pipeline_stages() -> None:
    """batches_in_flight 2 (pipeline stages): a second batch goes out before the first is answered and takes the
    other half of the requests; a request in flight, or held (a beam waiting for its search), is not scheduled
    again; each batch carries the tokens the last stage sampled since the one before (for the earlier stages),
    and an empty batch taken back keeps them for the next."""
    s = make_scheduler(batches_in_flight=2)
    for name in "abcd":
        add(s, name, 3)
    first = s.schedule()
    first_run = fake_runner_output(s, first)
    second = s.schedule()
    second_run = fake_runner_output(s, second)
    assert list(first.num_scheduled_tokens) == ["a", "b"] and list(second.num_scheduled_tokens) == ["c", "d"]
    empty = s.schedule()  # every request is in flight
    assert empty.is_empty and not empty.sampled_token_ids
    s.retract(empty)
    s.update_from_output(first_run)
    s.hold("b")
    third = s.schedule()
    assert third.num_scheduled_tokens == {"a": 1} and third.sampled_token_ids == {"a": [TOKEN], "b": [TOKEN]}
    s.update_from_output(second_run)
    fourth = s.schedule()
    assert fourth.num_scheduled_tokens == {"c": 1, "d": 1} and fourth.sampled_token_ids == {"c": [TOKEN], "d": [TOKEN]}
    fourth_run = fake_runner_output(s, fourth)
    s.update_from_output(fake_runner_output(s, third))
    s.hold("a")
    fifth = s.schedule()  # a and b held, c and d in flight: nothing to run, a's token to carry
    assert fifth.is_empty and fifth.sampled_token_ids == {"a": [TOKEN]}
    s.retract(fifth)
    s.update_from_output(fourth_run)
    sixth = s.schedule()
    assert sixth.num_scheduled_tokens == {"c": 1, "d": 1} and set(sixth.sampled_token_ids) == {"a", "c", "d"}
    s.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert "a" not in s.in_flight and "b" not in s.in_flight and "c" in s.in_flight
