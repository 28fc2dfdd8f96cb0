"""engine/dp_client.py with fake replicas: routing, aborts and stops following a request, a lost replica's
requests moved or failed, calls answered by every replica. (tests/distributed/test_data_parallel.py runs real
replica processes.)"""
from __future__ import annotations

import asyncio
import types
from pathlib import Path
from typing import Any

import pytest

from pagedllm.core.kv_cache_manager import prompt_routing_keys
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.engine.dp_client import DPClient
from pagedllm.engine.messages import (
    PROTOCOL_VERSION,
    Abort,
    Accepted,
    AddRequest,
    Call,
    CoreError,
    CoreReady,
    EngineStats,
    Reply,
    StepOutputs,
    Stop,
)
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import EngineCoreOutput
from pagedllm.sampling_params import SamplingParams


class FakeReplica:
    """What DPClient needs of an MPClient; the test plays the core."""

    def __init__(self, index: int, ready: CoreReady) -> None:
        self.index, self.ready = index, ready
        self.sent: list[Any] = []
        self.alive = True
        self.closed = False
        self.proc = types.SimpleNamespace(pid=1000 + index)

    def wait_ready(self) -> None:
        pass

    def start(self, on_message: Any, on_dead: Any) -> None:
        self.on_message, self.on_dead = on_message, on_dead

    def send(self, message: Any) -> None:
        self.sent.append(message)

    def is_alive(self) -> bool:
        return self.alive

    def close(self, timeout: float | None = None) -> None:
        self.closed = True

    def call_now(self, method: str, args: list) -> Any:
        self.sent.append(Call(call_id=-1, method=method, args=args))
        return True

    def step(self, outputs: list[EngineCoreOutput], stored: list[int] = ()) -> None:
        self.on_message(StepOutputs(outputs=outputs, beam_outputs=[], stats=EngineStats(num_steps=1),
                                    cache_stored=list(stored)))

    def die(self) -> None:
        self.alive = False
        self.on_dead(EngineDeadError("the engine core process exited with status -9"))


@pytest.fixture
def ready(tiny_llm_dir: Path) -> CoreReady:
    config, _ = EngineArgs(model=str(tiny_llm_dir), dtype="float32", block_size=16).create_engine_config()
    return CoreReady(version=PROTOCOL_VERSION, config=config, vocab_size=100, eos_token_ids=[0], num_kv_blocks=10,
                     stats=EngineStats())


def _client(tiny_llm_dir: Path, ready: CoreReady, **options: Any) -> tuple[DPClient, list[FakeReplica]]:
    fakes: list[FakeReplica] = []

    def factory(index: int) -> FakeReplica:
        fakes.append(FakeReplica(index, ready))
        return fakes[-1]

    args = EngineArgs(model=str(tiny_llm_dir), data_parallel_size=2, **options)
    return DPClient(args, replica_factory=factory), fakes


def _add(request_id: str, prompt: list[int], n: int = 1) -> AddRequest:
    return AddRequest(request_id=request_id, seq_ids=[f"{i}:{request_id}" for i in range(n)], prompt_ids=prompt,
                      params=SamplingParams(max_tokens=4, n=n), arrival_time=0.0)


def _out(seq_id: str, finished: bool = False) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=seq_id, new_token_ids=[5], finish_reason="length" if finished else None)


def test_requests_follow_their_prefix_and_their_aborts_and_stops_follow_them(tiny_llm_dir: Path,
                                                                             ready: CoreReady) -> None:
    async def main() -> None:
        dp, (r0, r1) = _client(tiny_llm_dir, ready)
        got: list[Any] = []
        dp.start(got.append, got.append)
        history = list(range(1, 49))  # three blocks of 16
        dp.send(_add("a", history))
        assert [m.request_id for m in r0.sent] == ["a"] and not r1.sent  # an idle server: the first replica
        r0.on_message(Accepted(request_id="a"))
        r0.step([_out("0:a", finished=True)], stored=prompt_routing_keys(history, 16))
        assert dp.router.load == [0, 0] and got[-1].engine_index == 0
        dp.send(_add("other", list(range(100, 148))))  # no hit anywhere: goes turn by turn
        dp.send(_add("b", history + [7] * 20))  # the conversation's next turn: back to its replica
        assert [m.request_id for m in r0.sent] == ["a", "b"] and [m.request_id for m in r1.sent] == ["other"]
        dp.send(Abort(request_id="other", seq_ids=["0:other"]))
        assert isinstance(r1.sent[-1], Abort) and dp.router.load == [1, 0]
        dp.send(Stop(seq_ids=["0:b"]))
        assert r0.sent[-1] == Stop(seq_ids=["0:b"]) and dp.router.load == [0, 0]
        dp.close()
        assert r0.closed and r1.closed

    asyncio.run(main())


def test_a_lost_replica_moves_what_has_not_streamed_and_fails_what_has(tiny_llm_dir: Path,
                                                                     ready: CoreReady) -> None:
    async def main() -> None:
        dp, (r0, r1) = _client(tiny_llm_dir, ready, data_parallel_routing="round-robin")
        got: list[Any] = []
        dead: list[Any] = []
        dp.start(got.append, dead.append)
        for name in ("s0", "streamed", "s2", "queued"):
            dp.send(_add(name, [1, 2, 3], n=2 if name == "streamed" else 1))
        assert [m.request_id for m in r1.sent] == ["streamed", "queued"]
        r1.on_message(Accepted(request_id="streamed"))
        r1.on_message(Accepted(request_id="queued"))
        r1.step([_out("0:streamed"), _out("1:streamed", finished=True)])
        got.clear()
        r1.die()
        # "queued" had streamed nothing: sent again to replica 0; its second Accepted is not passed on
        assert r0.sent[-1].request_id == "queued" and dp.router.load == [3, 0]
        r0.on_message(Accepted(request_id="queued"))
        [failed] = [m for m in got if isinstance(m, StepOutputs)]
        assert [(o.request_id, o.finish_reason) for o in failed.outputs] == [("0:streamed", "error")]
        assert "replica serving it stopped" in failed.outputs[0].error and failed.engine_index == 1
        assert not any(isinstance(m, Accepted) for m in got) and not dead
        states = dp.replica_states()
        assert [s["status"] for s in states] == ["running", "stopped"] and "status -9" in states[1]["error"]
        dp.send(_add("new", [4, 5, 6]))
        assert r0.sent[-1].request_id == "new"  # new requests go to the live replica
        r0.die()
        assert len(dead) == 1 and "every data-parallel replica stopped" in str(dead[0])
        with pytest.raises(EngineDeadError):
            dp.send(_add("late", [1]))
        dp.close()

    asyncio.run(main())


def test_calls_go_to_every_replica_and_answer_once(tiny_llm_dir: Path, ready: CoreReady) -> None:
    async def main() -> None:
        dp, (r0, r1) = _client(tiny_llm_dir, ready)
        got: list[Any] = []
        dp.start(got.append, got.append)
        dp.send(Call(call_id=7, method="kv_state", args=[]))
        c0, c1 = r0.sent[-1], r1.sent[-1]
        assert c0.method == c1.method == "kv_state" and c0.call_id != c1.call_id
        r1.on_message(Reply(call_id=c1.call_id, result={"accounting": {"used_blocks": 1}}))
        assert not got  # still waiting for replica 0
        r0.on_message(Reply(call_id=c0.call_id, result={"accounting": {"used_blocks": 0}}))
        [reply] = got
        assert reply.call_id == 7 and [r["accounting"]["used_blocks"] for r in reply.result["replicas"]] == [0, 1]
        got.clear()
        dp.send(Call(call_id=8, method="get_stats", args=[]))
        r0.on_message(Reply(call_id=r0.sent[-1].call_id, result=EngineStats(num_steps=2, num_kv_blocks=10)))
        r1.die()  # a replica lost mid-call: the call is answered by those left
        assert got[-1].call_id == 8 and got[-1].result.num_steps == 2
        dp.close()

    asyncio.run(main())


def test_a_moved_request_its_new_replica_refuses_ends_in_an_error(tiny_llm_dir: Path, ready: CoreReady) -> None:
    """The front has the request's Accepted from its first replica: the second one's refusal must end its stream
    (an error output), not arrive as an Accepted nobody waits for."""
    async def main() -> None:
        dp, (r0, r1) = _client(tiny_llm_dir, ready, data_parallel_routing="round-robin")
        got: list[Any] = []
        dp.start(got.append, got.append)
        dp.send(_add("x", [1, 2, 3]))
        r0.on_message(Accepted(request_id="x"))
        r0.die()
        assert r1.sent[-1].request_id == "x"
        got.clear()
        r1.on_message(Accepted(request_id="x", error=CoreError(type="ValidationError", message="too long")))
        [out] = got
        assert isinstance(out, StepOutputs) and out.outputs[0].finish_reason == "error"
        assert "refused it: too long" in out.outputs[0].error and dp.router.load == [0, 0] and not dp._routed
        dp.close()

    asyncio.run(main())


def test_a_replica_found_dead_when_sending_is_skipped(tiny_llm_dir: Path, ready: CoreReady) -> None:
    async def main() -> None:
        dp, (r0, r1) = _client(tiny_llm_dir, ready)
        dp.start(lambda m: None, lambda e: None)

        def gone(message: Any) -> None:
            raise EngineDeadError("the engine core process is gone")

        r0.send = gone  # its exit is not yet reported
        dp.send(_add("y", [1, 2, 3]))
        assert r1.sent[-1].request_id == "y" and dp.router.load == [0, 1]
        r1.send = gone
        with pytest.raises(EngineDeadError, match="no data-parallel replica"):
            dp.send(_add("z", [4]))
        assert "z" not in dp._routed
        dp.close()

    asyncio.run(main())


def test_a_restarted_replica_gets_the_adapters_and_serves_again(tiny_llm_dir: Path, ready: CoreReady) -> None:
    async def main() -> None:
        dp, fakes = _client(tiny_llm_dir, ready, data_parallel_restart=True)
        dead: list[Any] = []
        dp.start(lambda m: None, dead.append)
        lora = LoRARequest("a", 3, "/nowhere")
        dp.send(Call(call_id=1, method="add_lora", args=[lora]))
        fakes[1].die()
        assert [s["status"] for s in dp.replica_states()] == ["running", "starting"]
        for _ in range(100):  # loaded on the spawner thread, then handed to the event loop
            await asyncio.sleep(0.02)
            if dp.restarts[1]:
                break
        new = fakes[2]
        assert dp.replicas[1] is new and dp.restarts[1] == 1 and not dead
        assert [(c.method, c.args) for c in new.sent] == [("add_lora", [lora])]
        assert [s["status"] for s in dp.replica_states()] == ["running", "running"]
        dp.send(_add("r", [1]))
        dp.send(_add("s", [2]))
        assert new.sent[-1].request_id in ("r", "s")  # it takes requests again
        dp.close()
        assert new.closed

    asyncio.run(main())


def test_replicas_in_threads_are_refused(tiny_llm_dir: Path) -> None:
    """PAGEDLLM_ENABLE_MULTIPROCESSING=0 keeps a core in a thread: it cannot apply to replicas, and says so."""
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.errors import ValidationError
    with pytest.raises(ValidationError, match="PAGEDLLM_ENABLE_MULTIPROCESSING=0") as e:
        AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_llm_dir), data_parallel_size=2), multiprocess=False)
    assert e.value.param == "data_parallel_size"
