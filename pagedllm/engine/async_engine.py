"""The asyncio front of the engine: one background step loop, one output stream per request.

The engine runs in its own thread (torch releases the GIL, so the event loop keeps serving
HTTP meanwhile). The event loop never touches engine state: it sends commands (add, abort)
through a queue that the loop drains between steps, and receives outputs through per-request
asyncio queues.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.engine.llm_engine import EngineStats, LLMEngine
from pagedllm.engine.output_processor import IterationStats
from pagedllm.engine.processor import Processor, PromptType
from pagedllm.errors import ValidationError
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

KV_SAMPLE_INTERVAL_S = 1.0
KV_HISTORY_SAMPLES = 600
"""Ten minutes of the KV pool's accounting at one sample a second."""


class KVHistory:
    """The KV pool's accounting about once a second over the last minutes: the /kv page's chart (taken by
    whichever thread or process steps the engine)."""

    def __init__(self) -> None:
        self.samples: collections.deque = collections.deque(maxlen=KV_HISTORY_SAMPLES)
        self._last = 0.0

    def sample(self, engine: LLMEngine) -> None:
        """One point, unless the last is under KV_SAMPLE_INTERVAL_S old."""
        now = time.time()
        if now - self._last >= KV_SAMPLE_INTERVAL_S:
            self._last = now
            self.samples.append((now, engine.kv_map(cells=False)["accounting"]))

    def points(self) -> list[dict[str, Any]]:
        """The samples, oldest first, as {"time": unix time, **accounting}."""
        return [{"time": t, **a} for t, a in list(self.samples)]

#: Called by the engine thread after every step (and after aborts) with fresh statistics.
StepCallback = Callable[[EngineStats, IterationStats], None]


class EngineDeadError(RuntimeError):
    """The engine loop stopped with an error; no request can be served."""


@dataclasses.dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams | BeamSearchParams
    arrival_time: float
    stream: asyncio.Queue
    accepted: asyncio.Future
    lora_request: LoRARequest | None = None


@dataclasses.dataclass
class _Abort:
    request_id: str


@dataclasses.dataclass
class _Call:
    """Run ``fn(engine)`` between steps (engine state is the engine thread's); its result or ValidationError
    goes to ``done``."""

    fn: Callable[[LLMEngine], Any]
    done: asyncio.Future


class AsyncFront:
    """What the server's two engines share (AsyncLLMEngine here, AsyncLLM with the core in its own process)."""

    _waiting = 0
    """Requests the scheduler holds that have not run a step yet (as of the last statistics)."""
    _queued = 0
    """Requests sent to the engine loop and not yet taken."""

    @property
    def num_waiting(self) -> int:
        """Requests accepted or on their way that have not run a step yet (what load shedding counts)."""
        return self._waiting + self._queued

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | BeamSearchParams,
                          arrival_time: float | None = None, lora_request: LoRARequest | None = None
                          ) -> "RequestStream":
        raise NotImplementedError

    async def generate(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """``add_request`` and iterate its outputs in one call."""
        stream = await self.add_request(request_id, prompt, params, arrival_time)
        async for out in stream:
            yield out


class AsyncLLMEngine(AsyncFront):
    """Serves many concurrent callers from one engine; ``generate`` yields RequestOutputs."""

    def __init__(self, engine: LLMEngine, on_step: StepCallback | None = None,
                 on_dead: Callable[[BaseException], None] | None = None, step_log: str | None = None) -> None:
        self.engine = engine
        self.step_log = None if step_log is None else open(step_log, "a", buffering=1)
        """With a path: one JSON line per step, its features and seconds (`pagedllm plan --calibrate-from`)."""
        self.on_step = on_step
        self.on_dead = on_dead
        """Called once (from the engine thread) when the loop dies: e.g. the server exits non-zero."""
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self.dead_error: BaseException | None = None
        self._worker_failure: BaseException | None = None
        self._waiting = 0
        """Requests the scheduler holds that have not run a step yet (the engine thread writes it)."""
        self._queued = 0
        """Requests sent to the engine thread and not yet taken (guarded by _queued_lock: two threads change it)."""
        self._queued_lock = threading.Lock()
        self.kv_history = KVHistory()
        engine.executor.register_failure_callback(self._on_worker_failure)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, on_step: StepCallback | None = None,
                         on_dead: Callable[[BaseException], None] | None = None,
                         step_log: str | None = None) -> "AsyncLLMEngine":
        return cls(LLMEngine.from_engine_args(args, log_stats=True), on_step, on_dead, step_log)

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def processor(self) -> Processor:
        return self.engine.processor

    # ------------------------------------------------------------------ event-loop side
    def start(self) -> None:
        """Start the step loop; call from the event loop that will consume the outputs."""
        assert self._thread is None
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | BeamSearchParams,
                          arrival_time: float | None = None, lora_request: LoRARequest | None = None
                          ) -> "RequestStream":
        """Queue a request (a beam search with BeamSearchParams; with a LoRA adapter: ``lora_request``);
        returns its output stream, or raises ValidationError if it is refused."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running") from self.dead_error
        assert self._loop is not None
        if Processor.needs_preparation(params):  # its grammar compile and bad-words tokenizing: off the step loop
            await asyncio.to_thread(self.engine.processor.prepare, params)
        stream = RequestStream(self, request_id)
        accepted = self._loop.create_future()
        with self._queued_lock:
            self._queued += 1
        self._send(_Add(request_id, prompt, params, arrival_time or time.monotonic(), stream.queue, accepted,
                        lora_request))
        await accepted
        return stream

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """``fn(engine)`` run by the engine thread between two steps (e.g. ``lambda e: e.add_lora(r)``); its
        result, or the ValidationError it raised."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running") from self.dead_error
        assert self._loop is not None
        done = self._loop.create_future()
        self._send(_Call(fn, done))
        return await done

    def abort(self, request_id: str) -> None:
        """Abort a request (its blocks are freed before the next step)."""
        self._send(_Abort(request_id))

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    async def add_lora(self, lora: LoRARequest) -> bool:
        """Read and check an adapter between two steps; True if it was new."""
        return await self.call(lambda engine: engine.add_lora(lora))

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self.call(lambda engine: engine.remove_lora(lora_int_id))

    def add_lora_now(self, lora: LoRARequest) -> bool:
        """add_lora before start() (the server's --lora-modules)."""
        assert self._thread is None, "after start(): await add_lora"
        return self.engine.add_lora(lora)

    async def kv_state(self) -> dict[str, Any]:
        """The KV pool now (each block's holder, the accounting) and its recent history."""
        state = await self.call(lambda engine: engine.kv_map())
        return {**state, "history": self.kv_history.points()}

    def close(self) -> None:
        """Stop the engine's workers (processes, Ray actors) once the loop is stopped or never started;
        idempotent."""
        self.engine.shutdown()

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Abort everything still running, stop the loop and the engine's workers."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
        await asyncio.to_thread(self.engine.shutdown)
        if self.step_log is not None:
            self.step_log.close()

    def _send(self, command: _Add | _Abort | _Call) -> None:
        self._commands.put(command)
        self._wake.set()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while not self._stop:
                self._wake.clear()
                if self._worker_failure is not None:  # a worker died while the engine was idle
                    raise self._worker_failure
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self.kv_history.sample(self.engine)
                    self._wake.wait(timeout=1.0)
                    continue
                start = time.perf_counter()
                outputs = self.engine.step()
                if self.step_log is not None:  # the step as served: HTTP and clients share the machine
                    self.step_log.write(json.dumps({"features": self.engine.last_step_features,
                                                    "seconds": time.perf_counter() - start}) + "\n")
                self._deliver(outputs)
                self._report()
            self._abort_all()
        except BaseException as e:  # the loop is dead: tell every waiting caller, keep /health honest
            logger.exception("engine loop died")
            self.dead_error = e
            self._fail_all(e)
            if self.on_dead is not None:
                self.on_dead(e)

    def _on_worker_failure(self, error: BaseException) -> None:
        """The executor saw a worker fail (any thread): /health turns 503 now, the loop stops."""
        self._worker_failure = error
        self.dead_error = self.dead_error or error
        self._wake.set()

    def _pending_commands(self) -> Iterator[_Add | _Abort | _Call]:
        """The commands queued so far, oldest first (taken off the queue)."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply_commands(self) -> None:
        aborted = False
        for command in self._pending_commands():
            if isinstance(command, _Abort):
                self._streams.pop(command.request_id, None)
                self.engine.abort_request(command.request_id)
                aborted = True
                continue
            if isinstance(command, _Call):
                try:
                    result = command.fn(self.engine)
                except Exception as e:  # the caller gets it (a monitoring call must not stop the loop)
                    self._call(command.done.set_exception, e)
                else:
                    self._call(command.done.set_result, result)
                continue
            self._add(command)
        if aborted:
            self._report()  # gauges drop at once, not at the next step

    def _taken(self) -> None:
        """One queued add left the command queue."""
        with self._queued_lock:
            self._queued -= 1

    def _add(self, command: _Add) -> None:
        add = self.engine.add_beam_request if isinstance(command.params, BeamSearchParams) else self.engine.add_request
        try:
            add(command.request_id, command.prompt, command.params, command.arrival_time, command.lora_request)
        except Exception as e:  # refused (400) or failed (500): this request alone, the loop goes on
            if not isinstance(e, ValidationError):
                logger.warning("request %s could not be queued: %r", command.request_id, e, exc_info=True)
                self.engine.abort_request(command.request_id)  # nothing of it left behind
            self._taken()
            self._call(command.accepted.set_exception, e)
            return
        self._waiting += 1  # until the next step's statistics say how many still wait
        self._taken()  # after counting it as waiting: never counted nowhere
        self._streams[command.request_id] = command.stream
        self._call(command.accepted.set_result, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            self._call(stream.put_nowait, out)

    def _report(self) -> None:
        iteration = self.engine.take_iteration_stats()
        stats = self.engine.get_stats()
        self._waiting = stats.num_waiting
        self.kv_history.sample(self.engine)
        if self.on_step is not None:
            self.on_step(stats, iteration)

    def _abort_all(self) -> None:
        self.engine.abort_request(list(self.engine.output_processor.requests) + list(self.engine.beam_search.groups))
        self._fail_all(EngineDeadError("the engine was shut down"))

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            self._call(stream.put_nowait, error)
        self._streams.clear()
        for command in self._pending_commands():
            if isinstance(command, _Add):
                self._taken()
                self._call(command.accepted.set_exception, EngineDeadError("the engine is not running"))

    def _call(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._loop is not None
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_unless_cancelled, fn, *args)


class RequestStream:
    """The outputs of one request, in order; leaving the iteration early aborts the request."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str) -> None:
        self.engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError("the engine loop stopped") from item
                self.finished = item.finished
                yield item
        finally:
            self.abort()

    def abort(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


def _unless_cancelled(fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn`` unless it is a method of a future that is already done (its caller went away)."""
    target = getattr(fn, "__self__", None)
    if isinstance(target, asyncio.Future) and target.done():
        return
    fn(*args)

