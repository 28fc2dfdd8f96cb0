"""The worker comes up in vLLM's phases, each doing its own part, and runs the runner class of its model; a
step's failures are what the step returns, not state the runner keeps."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pagedllm.core.scheduler_output import NewRequestData, SchedulerOutput
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.pooling_runner import EncoderModelRunner, PoolingModelRunner
from pagedllm.worker.worker import Worker


def _worker(model: str, **options: object) -> Worker:
    config, arch = EngineArgs(model=model, dtype="float32", num_kv_blocks=16, **options).create_engine_config()
    return Worker(config, arch, eos_token_ids=(2,))


def test_each_phase_does_its_own_part(tiny_model: Callable[[str], Path]) -> None:
    worker = _worker(str(tiny_model("llama-gqa-untied")))
    assert worker.backend is None and worker.model_runner is None  # constructing loads and claims nothing
    with pytest.raises(AssertionError, match="init_device comes before load_model"):
        worker.load_model()
    worker.init_device()
    assert worker.backend is not None and worker.model_runner is None
    worker.load_model()
    runner = worker.model_runner
    assert type(runner) is ModelRunner and runner.kv_caches == [] and worker.load_report.weights_bytes > 0
    assert worker.determine_num_kv_blocks() == 16 and worker.determine_num_host_blocks() == 0
    worker.initialize_cache(16)
    assert len(runner.kv_caches) == worker.arch.num_layers and all(t.shape[1] == 16 for t in runner.kv_caches)
    worker.compile_or_warm_up_model()
    assert runner.graphs is None  # on the CPU nothing is captured


def test_the_model_picks_its_runner(tiny_model: Callable[[str], Path]) -> None:
    from pagedllm.models.loader.packaged import extract_packaged_model

    decoder = _worker(str(tiny_model("llama-gqa-untied")), runner="pooling")
    decoder.init_device()
    decoder.load_model()
    assert type(decoder.model_runner) is PoolingModelRunner
    encoder = _worker(extract_packaged_model())
    encoder.init_device()
    encoder.load_model()
    assert type(encoder.model_runner) is EncoderModelRunner


def test_a_steps_failures_are_its_own(tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.worker import model_runner

    def generator(params: SamplingParams, device: object) -> None:
        if params.seed == 13:
            raise RuntimeError("injected: generator")
        return None

    monkeypatch.setattr(model_runner, "_generator", generator)
    worker = _worker(str(tiny_model("llama-gqa-untied")))
    worker.init_device()
    worker.load_model()
    worker.initialize_cache(16)
    runner = worker.model_runner

    def new(req_id: str, block: int, params: SamplingParams) -> NewRequestData:
        return NewRequestData(req_id=req_id, prompt_token_ids=[5, 6, 7], sampling_params=params, block_ids=[block],
                              num_computed_tokens=0)

    bad = SamplingParams(max_tokens=4, seed=13)  # its sampling state cannot be made: it fails alone
    first = runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=[new("bad", 1, bad), new("good", 2, SamplingParams(max_tokens=4))],
        num_scheduled_tokens={"bad": 3, "good": 3}))
    assert set(first.failed) == {"bad"} and "injected: generator" in first.failed["bad"]
    assert len(first.sampled_token_ids) == 2
    second = runner.execute_model(SchedulerOutput(scheduled_new_reqs=[new("next", 3, SamplingParams(max_tokens=4))],
                                                  num_scheduled_tokens={"next": 3}, finished_req_ids={"bad"}))
    assert second.failed == {} and not hasattr(runner, "_failed")


def test_apply_model_runs_on_the_model(make_llm: Callable[..., Any]) -> None:
    from pagedllm import ValidationError

    llm = make_llm(num_kv_blocks=32, enable_sleep_mode=True)
    assert llm.apply_model(lambda model: type(model).__name__) == ["LlamaForCausalLM"]
    before = llm.apply_model(_embedding_sum)
    llm.sleep(level=2)
    with pytest.raises(ValidationError, match="asleep"):
        llm.apply_model(lambda model: model)
    llm.wake_up()
    assert llm.apply_model(_embedding_sum) == before  # the weights read again from the model's files
    llm.shutdown()


def _embedding_sum(model: Any) -> float:
    return float(model.model.embed_tokens.weight.float().sum())


def test_the_core_hands_its_tokenizer_on(make_llm: Callable[..., Any]) -> None:
    """An engine core's process loads its model's tokenizer once: the grammar compiler takes the core's."""
    from pagedllm.models.loader import tokenizer_of

    llm = make_llm(num_kv_blocks=32)
    core = llm.llm_engine.engine_core.core
    assert tokenizer_of(core.config.model.model) is llm.get_tokenizer()
    llm.shutdown()
