"""The one loop that steps an engine core for the server, in a thread of the API process or in a process of its
own (engine/core_proc.py): between steps it takes the front's messages; after each step it sends the outputs.

Only the channel differs (a queue here, ZeroMQ sockets there); failure isolation, request preparation off
the step, the step log and the KV history are this loop's, once.
"""
from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import queue
import time
from collections.abc import Callable
from typing import Any, Protocol

from pagedllm.engine.core import EngineCore
from pagedllm.engine.messages import (
    Abort,
    Accepted,
    AddBeamSearch,
    AddRequest,
    Call,
    CoreDead,
    CoreError,
    CoreMessage,
    FrontMessage,
    Reply,
    Shutdown,
    StepOutputs,
    Stop,
)
from pagedllm.engine.request_factory import RequestFactory
from pagedllm.engine.serial import encode, encode_error
from pagedllm.errors import ValidationError

logger = logging.getLogger(__name__)

IDLE_POLL_S = 1.0
"""An idle core wakes at least this often: to sample the KV pool and notice a dead parent."""
PREPARE_POLL_S = 0.005
"""While a request is being prepared and nothing runs, the loop looks for its end this often."""
CALLS = ("add_lora", "remove_lora", "list_loras", "kv_state", "rank_memory_usage", "get_stats", "pause", "resume",
         "is_paused", "sleep", "release_kv_cache_memory", "wake_up", "is_sleeping", "collective_rpc")
"""What a front may call between steps (by name: nothing else can be run)."""
PAUSING_CALLS = ("pause", "sleep", "release_kv_cache_memory")
"""Calls answered once the pause they start completes (engine/lifecycle.py: "wait" drains the running requests
first)."""
KV_SAMPLE_INTERVAL_S = 1.0
KV_HISTORY_SAMPLES = 600
"""Ten minutes of the KV pool's accounting at one sample a second."""


class CoreChannel(Protocol):
    """The loop's side of its link to the front."""

    def poll(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a message; whether one is waiting."""

    def recv(self) -> FrontMessage | None:
        """The next message (poll said one waits); None for a wake-up that carries none."""

    def send(self, message: CoreMessage) -> None:
        """One message to the front."""

    def wake(self) -> None:
        """Make a waiting poll return now (any thread)."""

    def front_alive(self) -> bool:
        """False once the front is gone (the loop then stops)."""


class KVHistory:
    """The KV pool's accounting about once a second over the last minutes: the /kv page's chart."""

    def __init__(self) -> None:
        self.samples: collections.deque = collections.deque(maxlen=KV_HISTORY_SAMPLES)
        self._last = 0.0

    def sample(self, core: EngineCore) -> None:
        """One point, unless the last is under KV_SAMPLE_INTERVAL_S old."""
        now = time.time()
        if now - self._last >= KV_SAMPLE_INTERVAL_S:
            self._last = now
            self.samples.append((now, core.kv_map(cells=False)["accounting"]))

    def points(self) -> list[dict[str, Any]]:
        """The samples, oldest first, as {"time": unix time, **accounting}."""
        return [{"time": t, **a} for t, a in list(self.samples)]


class EngineCoreLoop:
    """Steps ``core`` while it has work, applying the front's messages in between; see the module docstring."""

    def __init__(self, core: EngineCore, channel: CoreChannel, step_log: str | None = None) -> None:
        self.core = core
        self.channel = channel
        self.step_log = None if step_log is None else open(step_log, "a", buffering=1)
        """With a path: one JSON line per step, its features and seconds (`pagedllm plan --calibrate-from`)."""
        self.stop = False
        self.worker_failure: BaseException | None = None
        self.kv_history = KVHistory()
        self._preparing: dict[str, tuple[concurrent.futures.Future, AddRequest]] = {}
        """Requests whose preparation runs in ``_prepare_pool`` (by request id, in arrival order)."""
        # one thread: a heavy request's grammar compile takes one core, never the step's share of the rest
        self._prepare_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedllm-prepare")
        self._held: list[AddRequest | AddBeamSearch] = []
        """Requests that arrived while the core was paused or asleep (not refused): queued when it resumes."""
        self._pausing: list[int] = []
        """Calls (ids) of a pause that waits for the running requests: answered when it completes."""
        core.lifecycle.serving = True
        core.executor.register_failure_callback(self._on_worker_failure)

    def _on_worker_failure(self, error: BaseException) -> None:  # any thread: the loop raises it
        self.worker_failure = error
        self.channel.wake()

    def run(self) -> int:
        """Step until told to stop (0), or until the core fails or the front is gone (1; a failure is sent
        as CoreDead first)."""
        try:
            while not self.stop:
                if self.worker_failure is not None:
                    raise self.worker_failure
                if not self.channel.front_alive():
                    logger.error("the API server is gone: the engine core stops")
                    return 1
                self._admit_prepared()
                if not self.core.has_unfinished_requests():
                    self.kv_history.sample(self.core)
                    # a request being prepared is looked at again soon; otherwise sleep until a message comes
                    if not self.channel.poll(PREPARE_POLL_S if self._preparing else IDLE_POLL_S):
                        continue
                self._apply_messages()
                if not self.stop and self.core.has_unfinished_requests():
                    self._step()
                self._finish_pause()
            return 0
        except BaseException as e:  # the front answers 503 and fails its requests
            logger.exception("engine core died")
            self.channel.send(CoreDead(error=encode_error(e)))
            return 1
        finally:
            self._prepare_pool.shutdown(wait=False, cancel_futures=True)
            if self.step_log is not None:
                self.step_log.close()

    def _step(self) -> None:
        start = time.perf_counter()
        outputs = self.core.step()
        if self.step_log is not None:  # the step as served: HTTP and clients share the machine
            self.step_log.write(json.dumps({"features": self.core.last_step_features,
                                            "seconds": time.perf_counter() - start}) + "\n")
        self.channel.send(outputs)
        self.kv_history.sample(self.core)

    def _apply_messages(self) -> None:
        aborted = False
        while not self.stop and self.channel.poll(0):
            try:
                message = self.channel.recv()
            except Exception:  # one malformed message must not stop everyone's requests
                logger.exception("an engine core message could not be read (skipped)")
                continue
            if message is None:  # a wake-up
                continue
            if isinstance(message, (AddRequest, AddBeamSearch)):
                self._add(message)
            elif isinstance(message, Abort):
                self._cancel_preparing(message.request_id)
                self._cancel_held(message.request_id)
                self.core.abort(message)
                aborted = True
            elif isinstance(message, Stop):
                self.core.stop(message.seq_ids)
                aborted = True
            elif isinstance(message, Call):
                self._call(message)
            elif isinstance(message, Shutdown):
                self.stop = True
            else:
                raise ValueError(f"unknown engine core message {type(message).__name__}")
        if aborted:  # gauges drop at once, not at the next step
            self.channel.send(StepOutputs(outputs=[], beam_outputs=[], stats=self.core.get_stats()))

    def _add(self, request: AddRequest | AddBeamSearch) -> None:
        """Queue a request, or first prepare it in the preparation thread (its grammar, its bad words) when
        that has work: the loop keeps stepping the others meanwhile."""
        if (isinstance(request, AddRequest) and RequestFactory.needs_preparation(request.params)
                and request.request_id not in self._preparing):
            future = self._prepare_pool.submit(self.core.request_factory.prepare, request.params)
            self._preparing[request.request_id] = (future, request)
            return
        self._queue(request)

    def _queue(self, request: AddRequest | AddBeamSearch) -> None:
        if self.core.lifecycle.admission() == "hold":  # accepted once the core resumes (the caller waits)
            self._held.append(request)
            return
        try:
            if isinstance(request, AddRequest):
                self.core.add_request(request)
            else:
                self.core.add_beam_search(request)
        except Exception as e:  # refused (400) or failed (500): this request alone, the loop goes on
            if not isinstance(e, ValidationError):
                logger.warning("request %s could not be queued: %r", request.request_id, e, exc_info=True)
            self.channel.send(Accepted(request_id=request.request_id, error=encode_error(e)))
            return
        self.channel.send(Accepted(request_id=request.request_id))

    def _admit_prepared(self) -> None:
        """Queue the requests whose preparation finished (or answer its error), in the order they came."""
        for request_id, (future, request) in list(self._preparing.items()):
            if not future.done():
                continue
            del self._preparing[request_id]
            error = future.exception()
            if error is not None:
                self.channel.send(Accepted(request_id=request_id, error=encode_error(error)))
            else:
                self._queue(request)

    def _cancel_preparing(self, request_id: str) -> None:
        """An abort of a request still being prepared: it is never queued (its front is told, for the count)."""
        entry = self._preparing.pop(request_id, None)
        if entry is not None:
            entry[0].cancel()
            error = ValidationError("the request was aborted while it was being prepared")
            self.channel.send(Accepted(request_id=request_id, error=encode_error(error)))

    def _cancel_held(self, request_id: str) -> None:
        """An abort of a request held while paused: it is never queued (its front is told, for the count)."""
        for request in [r for r in self._held if r.request_id == request_id]:
            self._held.remove(request)
            error = ValidationError("the request was aborted while generation was paused")
            self.channel.send(Accepted(request_id=request_id, error=encode_error(error)))

    def _call(self, call: Call) -> None:
        try:
            result = self.call(call.method, call.args)
            if call.method in PAUSING_CALLS:
                if result:  # the finishes of the requests "abort" ended reach their callers before the answer
                    self.channel.send(StepOutputs(outputs=result, beam_outputs=[], stats=self.core.get_stats()))
                result = None
                if not self.core.lifecycle.try_finish():
                    self._pausing.append(call.call_id)
                    return
        except Exception as e:  # the caller gets it (a monitoring call must not stop the loop)
            self.channel.send(Reply(call_id=call.call_id, error=encode_error(e)))
            return
        self.channel.send(Reply(call_id=call.call_id, result=result))
        self._release_held()

    def _finish_pause(self) -> None:
        """Answer the waiting pause calls once their pause completed (or was resumed meanwhile)."""
        if not self._pausing:
            return
        try:
            if not self.core.lifecycle.try_finish():
                return
        except Exception as e:  # e.g. a worker could not sleep: the callers hear it
            error: CoreError | None = encode_error(e)
        else:
            error = None
        calls, self._pausing = self._pausing, []
        for call_id in calls:
            self.channel.send(Reply(call_id=call_id, error=error))

    def _release_held(self) -> None:
        """After a call that resumed the core: the requests held meanwhile are queued, in arrival order."""
        if self._held and self.core.lifecycle.admission() != "hold":
            held, self._held = self._held, []
            for request in held:
                self._add(request)

    def call(self, method: str, args: list[Any]) -> Any:
        """One of CALLS on the core (sets come back as lists: what msgpack carries)."""
        if method not in CALLS:
            raise ValueError(f"the engine core has no call {method!r}")
        if method == "kv_state":  # the /kv page's data: each block now and the accounting's recent history
            return {**self.core.kv_map(), "history": self.kv_history.points()}
        result = getattr(self.core, method)(*args)
        if method == "collective_rpc":  # what the front can be sent: anything else as its text (as vLLM's route)
            return [value if _sendable(value) else str(value) for value in result]
        return list(result) if isinstance(result, set) else result


def _sendable(value: Any) -> bool:
    """Whether msgpack carries ``value`` (plain data) to the front."""
    try:
        encode(value)
    except (TypeError, ValueError, OverflowError):
        return False
    return True


class QueueChannel:
    """A loop in a thread of the front's process: messages in through a queue, out through ``deliver`` (called
    from the loop's thread)."""

    def __init__(self, deliver: Callable[[CoreMessage], None]) -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._deliver = deliver
        self._next: list[FrontMessage | None] = []
        """A message poll took off the queue, for recv."""

    def put(self, message: FrontMessage) -> None:
        """The front's side: one message for the loop (any thread)."""
        self._inbox.put(message)

    def poll(self, timeout_s: float) -> bool:
        if self._next:
            return True
        try:
            self._next.append(self._inbox.get(timeout=timeout_s) if timeout_s > 0 else self._inbox.get_nowait())
        except queue.Empty:
            return False
        return True

    def recv(self) -> FrontMessage | None:
        return self._next.pop() if self._next else self._inbox.get_nowait()

    def send(self, message: CoreMessage) -> None:
        self._deliver(message)

    def wake(self) -> None:
        self._inbox.put(None)

    def front_alive(self) -> bool:
        return True

    def pending(self) -> list[FrontMessage]:
        """Take what the loop never read (after it stopped)."""
        out = [m for m in self._next if m is not None]
        self._next.clear()
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return out
            if message is not None:
                out.append(message)
