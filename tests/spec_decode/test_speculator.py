"""The speculation policy: opt-out, the batch-size limit, and the back-off of a request whose drafts fail."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedllm.config import SpeculativeConfig
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.speculator import MIN_BACKOFF, Speculator


class Echo:
    """Proposes the last token ``num_tokens`` times; remembers what finished."""

    def __init__(self) -> None:
        self.finished: list[str] = []

    def propose(self, req_id: str, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        return [token_ids[-1]] * num_tokens

    def finish(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self.finished.append(req_id)


@dataclass
class State:
    req_id: str
    token_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    num_prompt_tokens: int = 2
    sampling_params: SamplingParams = field(default_factory=SamplingParams)


def _speculator(**config) -> tuple[Speculator, Echo]:
    proposer = Echo()
    return Speculator(SpeculativeConfig(num_speculative_tokens=3, **config), proposer), proposer


def test_opt_out_and_batch_limit() -> None:
    spec, _ = _speculator(disable_by_batch_size=2)
    off = State("off", sampling_params=SamplingParams(speculate=False))
    assert spec.propose([State("a"), off]) == {"a": [3, 3, 3]}
    assert spec.propose([State("a"), State("b"), State("c")]) == {}  # 3 sequences > 2


def test_a_failing_request_backs_off_longer_each_time_and_recovers() -> None:
    spec, proposer = _speculator(min_acceptance_rate=0.5)
    a, b = State("a"), State("b")
    fails = 0
    while "a" in spec.propose([a, b]):  # every draft of a rejected, b's accepted
        spec.record("a", 3, 0)
        spec.record("b", 3, 3)
        fails += 1
    assert fails > 1  # one bad step lowers the average, it does not stop speculation at once
    skipped = 1
    while "a" not in spec.propose([a, b]):
        skipped += 1
    assert skipped == MIN_BACKOFF
    spec.record("a", 3, 0)  # fails again at once: the next back-off is twice as long
    skipped = 0
    while "a" not in spec.propose([a]):
        skipped += 1
    assert skipped == 2 * MIN_BACKOFF
    spec.finish("a", a.token_ids, 2)
    assert proposer.finished == ["a"] and "a" not in spec.records


def test_no_back_off_at_a_zero_floor() -> None:
    spec, _ = _speculator(min_acceptance_rate=0.0)
    for _ in range(50):
        assert spec.propose([State("a")]) == {"a": [3, 3, 3]}
        spec.record("a", 3, 0)


def test_a_failing_proposer_costs_only_that_requests_drafts() -> None:
    class Flaky(Echo):
        def propose(self, req_id: str, token_ids: Sequence[int], num_tokens: int) -> list[int]:
            if req_id == "bad":
                raise RuntimeError("broken index")
            return super().propose(req_id, token_ids, num_tokens)

    spec = Speculator(SpeculativeConfig(num_speculative_tokens=2), Flaky())
    assert spec.propose([State("bad"), State("good")]) == {"good": [3, 3]}
