"""A failure while handling one request fails that request alone: fault injection at each per-request stage.

Each test raises inside one stage for one request only (its seed's generator, its grammar matcher, its
grammar's advance, its logits processors, its beam search step, its detokenizing) while other requests run
in the same steps, and checks that only that request ends with finish_reason "error" (and its message), the
others finish as they would alone, no KV block is left held, and the engine keeps serving.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest

from pagedllm import LLM
from pagedllm.engine.beam_search import BeamSearchManager
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.errors import ValidationError
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from pagedllm.worker import input_batch, model_runner
from pagedllm.worker.structured_output import Matcher
from tests.utils import assert_pool_clean

LLM_OPTIONS = {"num_kv_blocks": 64, "max_model_len": 128}
POISON_SEED = 4242
"""The seed that marks the one request whose stage is made to fail."""


def _run(llm: LLM, params: list[SamplingParams]) -> list[RequestOutput]:
    """Every request through the engine's own loop (the server's step), each with its own parameters."""
    engine = llm.llm_engine
    for i, p in enumerate(params):
        engine.add_request(f"iso-{i}", "the quick brown fox", p)
    done: dict[str, RequestOutput] = {}
    for _ in range(200):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    return [done[f"iso-{i}"] for i in range(len(params))]


def _check_only_poisoned_failed(llm: LLM, outs: list[RequestOutput], stage: str) -> None:
    poisoned, healthy = outs[0], outs[1:]
    assert poisoned.error is not None and stage in poisoned.error, poisoned.error
    assert all(c.finish_reason == "error" for c in poisoned.outputs)
    for out in healthy:
        assert out.error is None
        assert all(c.finish_reason == "length" and len(c.token_ids) == 6 for c in out.outputs)
    assert_pool_clean(llm)
    again = llm.generate(["still serving"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert again.error is None and len(again.outputs[0].token_ids) == 3


def _sampled(seed: int | None, **extra: object) -> SamplingParams:
    return SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, seed=seed, **extra)


def _poisoned(original: Callable, stage_error: str) -> Callable:
    """``original`` that raises for the poisoned request's parameters (its seed), else runs as before."""
    def wrapper(params: SamplingParams, *args: object, **kwargs: object) -> object:
        if getattr(params, "seed", None) == POISON_SEED:
            raise RuntimeError(stage_error)
        return original(params, *args, **kwargs)
    return wrapper


def test_a_failing_seed_generator_fails_its_request_alone(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_runner, "_generator", _poisoned(model_runner._generator, "injected: generator"))
    outs = _run(llm, [_sampled(POISON_SEED), _sampled(1), _sampled(None)])
    _check_only_poisoned_failed(llm, outs, "sampling state")
    assert "injected: generator" in outs[0].error


def test_n_samples_one_failing_fail_the_request_and_free_every_block(llm: LLM,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    original = model_runner._generator

    def second_sample_fails(params: SamplingParams, device: object) -> object:
        if params.seed == POISON_SEED + 1:  # sample 1 of the request seeded POISON_SEED
            raise RuntimeError("injected: sample 1")
        return original(params, device)

    monkeypatch.setattr(model_runner, "_generator", second_sample_fails)
    outs = _run(llm, [_sampled(POISON_SEED, n=3), _sampled(7)])
    assert outs[0].error is not None and "injected: sample 1" in outs[0].error
    assert [c.finish_reason for c in outs[0].outputs].count("error") >= 1
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 6
    assert_pool_clean(llm)


def test_a_failing_grammar_matcher_fails_its_request_alone(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_runner.ModelRunner, "_matcher",
                        lambda self, params, accepted: (_ for _ in ()).throw(RuntimeError("injected: matcher"))
                        if params.seed == POISON_SEED else None)
    regex = StructuredOutputsParams(regex="[a-z]+")
    outs = _run(llm, [_sampled(POISON_SEED, structured_outputs=regex), _sampled(3), _sampled(None)])
    _check_only_poisoned_failed(llm, outs, "sampling state")


def test_a_grammar_that_fails_to_advance_fails_its_request_alone(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    def accept(self: Matcher, token: int) -> bool:
        raise RuntimeError("injected: accept_token")
    monkeypatch.setattr(Matcher, "accept_token", accept)
    regex = StructuredOutputsParams(regex="[a-z ]+")
    outs = _run(llm, [_sampled(POISON_SEED, structured_outputs=regex), _sampled(3), _sampled(None)])
    _check_only_poisoned_failed(llm, outs, "advancing the request's grammar")


def test_failing_logits_processors_fail_their_request_alone(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    original = input_batch._row_logits_processors

    def row(md: object, index: int, state: object, *args: object) -> None:
        if state.sampling_params.seed == POISON_SEED:
            raise RuntimeError("injected: logits processor")
        original(md, index, state, *args)

    monkeypatch.setattr(input_batch, "_row_logits_processors", row)
    outs = _run(llm, [_sampled(POISON_SEED, logit_bias={5: 1.0}), _sampled(3, logit_bias={5: 1.0}), _sampled(None)])
    _check_only_poisoned_failed(llm, outs, "logits processors")


def test_failing_detokenizing_fails_its_request_alone(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    original_init, original_update = IncrementalDetokenizer.__init__, IncrementalDetokenizer.update

    def init(self: IncrementalDetokenizer, tokenizer: object, prompt: list[int], params: SamplingParams) -> None:
        original_init(self, tokenizer, prompt, params)
        self.poisoned = params.seed == POISON_SEED

    def update(self: IncrementalDetokenizer, *args: object, **kwargs: object) -> object:
        if self.poisoned:
            raise RuntimeError("injected: detokenizer")
        return original_update(self, *args, **kwargs)

    monkeypatch.setattr(IncrementalDetokenizer, "__init__", init)
    monkeypatch.setattr(IncrementalDetokenizer, "update", update)
    outs = _run(llm, [_sampled(POISON_SEED), _sampled(3), _sampled(None)])
    _check_only_poisoned_failed(llm, outs, "processing the output")


def test_a_failing_beam_step_fails_its_search_alone(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    original = BeamSearchManager._step

    def step(self: BeamSearchManager, group: object) -> object:
        if group.request_id == "beam-bad":
            raise ZeroDivisionError("injected: beam step")
        return original(self, group)

    monkeypatch.setattr(BeamSearchManager, "_step", step)
    engine = llm.llm_engine
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    engine.add_beam_request("beam-bad", "the quick brown fox", params)
    engine.add_beam_request("beam-good", "the quick brown fox", params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["beam-bad"].error is not None and "injected: beam step" in done["beam-bad"].error
    assert done["beam-good"].error is None and len(done["beam-good"].outputs) == 2
    assert_pool_clean(llm)


@pytest.mark.parametrize("length_penalty", [-1e308, 1e308, float("-inf"), float("nan"), 41.0])
def test_length_penalty_is_finite_and_bounded(length_penalty: float) -> None:
    with pytest.raises(ValidationError) as e:
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=length_penalty)
    assert e.value.param == "length_penalty"


@pytest.mark.parametrize("seed, n", [(2 ** 64 - 1, 1), (2 ** 63 - 1, 2), (-(2 ** 63) - 1, 1), (2 ** 63, 1)])
def test_every_samples_seed_fits_64_bits(seed: int, n: int) -> None:
    with pytest.raises(ValidationError) as e:
        SamplingParams(seed=seed, n=n)
    assert e.value.param == "seed"
    SamplingParams(seed=2 ** 63 - n, n=n)  # the largest allowed: its last sample's seed is 2**63 - 1
