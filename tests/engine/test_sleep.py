"""vLLM's RL controls offline: LLM.sleep / wake_up / is_sleeping release and restore real memory, and
LLM.collective_rpc reaches the workers (and a --worker-extension-cls class mixed into them)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.errors import ValidationError

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = {"prompt_token_ids": list(range(20, 60))}


class Extension:
    """A worker extension as RL frameworks write them (tests/engine/test_sleep.py.Extension)."""

    def init_worker_extension(self) -> None:
        self.extension_ready = True

    def echo(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {"args": list(args), "kwargs": kwargs, "ready": self.extension_ready}

    def fail(self) -> None:
        raise RuntimeError("the extension failed")


def kv_and_weights(llm: LLM) -> tuple[float, float]:
    usage = llm.llm_engine.rank_memory_usage()[0]
    return usage["kv_cache_bytes"], usage["weights_bytes"]


def text(llm: LLM) -> list[int]:
    return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_sleep_levels_release_memory_and_wake_serves_the_same(tiny_llm_dir: Path) -> None:
    llm = LLM(str(tiny_llm_dir), dtype="float32", num_kv_blocks=256, enable_sleep_mode=True,
              worker_extension_cls="tests.engine.test_sleep.Extension")
    try:
        before = text(llm)
        kv, weights = kv_and_weights(llm)
        assert kv > 0 and weights > 0 and not llm.is_sleeping()

        llm.sleep(level=1)
        assert llm.is_sleeping() and kv_and_weights(llm) == (0, weights)  # the pool tensors are gone
        with pytest.raises(ValidationError, match="asleep"):
            llm.generate(PROMPT, GREEDY, use_tqdm=False)
        assert llm.wake_up(["weights"]) is False and llm.is_sleeping()  # a partial wake keeps it asleep
        assert llm.wake_up(["kv_cache"]) is True and not llm.is_sleeping()
        assert kv_and_weights(llm) == (kv, weights) and text(llm) == before

        llm.sleep(level=2)  # the weights go too; wake_up reads them again
        assert kv_and_weights(llm) == (0, 0)
        assert llm.wake_up() is True and text(llm) == before

        # collective_rpc: a worker method, the extension's (its init hook ran), a function, failures alone
        assert llm.collective_rpc("echo", args=("a", 1), kwargs={"k": "v"}) == [
            {"args": ["a", 1], "kwargs": {"k": "v"}, "ready": True}]
        assert llm.collective_rpc(kv_and_weights_of_worker)[0] == kv
        with pytest.raises(ValidationError) as e:
            llm.collective_rpc("no_such_method")
        assert e.value.param == "method"
        with pytest.raises(RuntimeError, match="the extension failed"):
            llm.collective_rpc("fail")
        assert text(llm) == before  # the engine goes on
    finally:
        llm.shutdown()


def kv_and_weights_of_worker(worker: Any) -> int:
    return worker.memory_usage()["kv_cache_bytes"]


def test_sleep_refusals(make_llm: Any) -> None:
    llm = make_llm(num_kv_blocks=64)
    with pytest.raises(ValidationError) as e:
        llm.sleep(level=1)  # without enable_sleep_mode
    assert e.value.param == "level"
    for bad in ({"level": 3}, {"level": True}, {"level": 0, "mode": "later"}):
        with pytest.raises(ValidationError) as e:
            llm.sleep(**bad)
        assert e.value.param in bad
    with pytest.raises(ValidationError) as e:
        llm.wake_up(["gpu"])
    assert e.value.param == "tags"
    llm.sleep(level=0)  # pauses scheduling only: no flag needed
    assert llm.is_sleeping() and llm.wake_up(["scheduling"]) and not llm.is_sleeping()
    with pytest.raises(ValidationError) as e:
        LLM(worker_extension_cls="tests.engine.test_sleep.NoSuchClass")
    assert e.value.param == "worker_extension_cls"
    llm.shutdown()
