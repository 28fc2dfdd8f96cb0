"""The API process's side of an engine core in its own process (vLLM v1's AsyncLLM + EngineCore).

This process tokenizes prompts, detokenizes outputs (stop strings, logprobs' text) and serves HTTP;
the core process (engine/core_proc.py) schedules and runs the model. A thread here receives the
core's messages and hands them to the event loop, which owns every piece of state: requests,
streams, the output processor, and the only socket that sends.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from pagedllm.config import EngineArgs
from pagedllm.engine.async_engine import AsyncFront, AsyncLLMEngine, EngineDeadError, RequestStream, StepCallback
from pagedllm.engine.llm_engine import EngineStats
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.processor import Processor, PromptType
from pagedllm.engine.serial import decode, decode_error, encode
from pagedllm.errors import ValidationError
from pagedllm.lora_request import LoRARequest
from pagedllm.models.loader import load_tokenizer, resolve_model_path
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

RECEIVE_POLL_MS = 200
"""How often the receiving thread checks that the core process is alive while it says nothing."""
CORE_EXIT_TIMEOUT_S = 15.0
"""A core told to shut down gets this long (its workers stop too) before SIGKILL."""


class AsyncLLM(AsyncFront):
    """AsyncLLMEngine's interface, with the engine core in a child process; see the module docstring."""

    def __init__(self, args: EngineArgs, on_step: StepCallback | None = None,
                 on_dead: Callable[[BaseException], None] | None = None, step_log: str | None = None) -> None:
        """Start the core process and wait until its engine is loaded (raises what the load raised)."""
        self.on_step = on_step
        self.on_dead = on_dead
        self.dead_error: BaseException | None = None
        self._core_error: BaseException | None = None
        self._closing = False
        """Set once shutdown began: nothing more is sent but "shutdown", the core's exit is no death."""
        self._closed = False
        self._ready = False
        self._receiver: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.proc: subprocess.Popen | None = None
        self._dir: str | None = tempfile.mkdtemp(prefix="pagedllm-core-")  # 0700: only this user connects
        self._base = f"ipc://{self._dir}"
        self._ctx = zmq.Context()
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._from_core = self._ctx.socket(zmq.PULL)
        try:
            for sock, name in ((self._to_core, "commands"), (self._from_core, "results")):
                sock.setsockopt(zmq.LINGER, 0)
                sock.bind(f"{self._base}/{name}")
            self.proc = subprocess.Popen([sys.executable, "-m", "pagedllm.engine.core_proc",
                                          f"{self._base}/commands", f"{self._base}/results"])
            self._send(["start", args, step_log])
            self.tokenizer = load_tokenizer(resolve_model_path(args.model))  # while the core loads the model
            info = self._recv_now("ready")
        except BaseException:
            self.close()
            raise
        # both connections are up (the core read "start" and we read "ready"): the socket files are no longer
        # needed, and gone now they cannot be left in the temp folder if this process is killed
        shutil.rmtree(self._dir, ignore_errors=True)
        self._dir = None
        self._ready = True
        self.config = info["config"]
        self.num_kv_blocks: int = info["num_kv_blocks"]
        self.processor = Processor(self.tokenizer, self.config.model.max_model_len, info["vocab_size"],
                                   tuple(info["eos_token_ids"]))
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=True)
        self._stats: EngineStats = info["stats"]
        self._streams: dict[str, asyncio.Queue] = {}
        self._beams: set[str] = set()
        self._accepting: dict[str, asyncio.Future] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._seq_counter = itertools.count()
        self._waiting = 0
        self._queued = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs, on_step: StepCallback | None = None,
                         on_dead: Callable[[BaseException], None] | None = None,
                         step_log: str | None = None) -> "AsyncLLM":
        return cls(args, on_step, on_dead, step_log)

    def _recv_now(self, kind: str, call_id: int | None = None) -> Any:
        """Before start(): wait for the core's ``kind`` message (a reply: to ``call_id``); raise what the core
        reports instead, or EngineDeadError if it exits."""
        while True:
            while not self._from_core.poll(RECEIVE_POLL_MS):
                if self.proc.poll() is not None:
                    raise EngineDeadError(f"the engine core process exited with status {self.proc.returncode}"
                                          + ("" if self._ready else " while loading")) from self._core_error
            got, *payload = decode(self._from_core.recv())
            if got in ("startup_error", "dead"):
                self._core_error = decode_error(payload[0])
                if got == "startup_error":
                    raise self._core_error
            elif got == kind == "ready":
                return payload[0]
            elif got == kind == "reply" and payload[0] == call_id:
                if payload[1] is not None:
                    raise decode_error(payload[1])
                return payload[2]

    # ------------------------------------------------------------------ event-loop side
    def start(self) -> None:
        """Start handing the core's messages to this event loop; call from it."""
        assert self._receiver is None
        self._loop = asyncio.get_running_loop()
        self._receiver = threading.Thread(target=self._receive, name="pagedllm-core-receiver", daemon=True)
        self._receiver.start()

    @property
    def is_running(self) -> bool:
        return (self._receiver is not None and self._receiver.is_alive() and self.dead_error is None
                and not self._closing and self.proc.poll() is None)

    def get_stats(self) -> EngineStats:
        """The core's counters after its last step."""
        return self._stats

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | BeamSearchParams,
                          arrival_time: float | None = None, lora_request: LoRARequest | None = None
                          ) -> RequestStream:
        """Tokenize and send a request; returns its output stream once the core accepted it (ValidationError if
        either process refuses it)."""
        self._check_running()
        if request_id in self.output_processor.requests or request_id in self._beams or request_id in self._accepting:
            raise ValidationError(f"request id {request_id!r} is already in use", param="request_id", value=request_id)
        text, prompt_ids = self.processor.tokenize_prompt(prompt)
        arrival_time = arrival_time or time.monotonic()
        seq_ids: list[str] = []
        if isinstance(params, BeamSearchParams):
            message = ["beam", request_id, text, prompt_ids, params, arrival_time, lora_request]
        else:
            if not isinstance(params, SamplingParams):
                raise ValidationError.bad_value("sampling_params", params, "a SamplingParams")
            # "a" for the API process: the core's own ids (a beam's) never look the same
            seq_ids = [f"a{next(self._seq_counter)}:{request_id}" for _ in range(params.n)]
            cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
            message = ["add", request_id, seq_ids, prompt_ids, params, arrival_time, cache_salt, lora_request]
        data = _encode_request(message, params)
        if seq_ids:
            self.output_processor.add_request(request_id, text, prompt_ids, params, seq_ids, arrival_time)
        else:
            self._beams.add(request_id)
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream.queue
        accepted = self._accepting[request_id] = self._new_future()
        try:
            self._send(data)
            self._queued += 1  # until its "accepted" arrives (counted there, in message order)
            await accepted
        except BaseException as e:
            self._streams.pop(request_id, None)
            self._accepting.pop(request_id, None)
            self.output_processor.discard(request_id)
            self._beams.discard(request_id)
            if not isinstance(e, ValidationError):  # e.g. the client went away: the core may have it queued
                self._send_quietly(["abort", request_id, seq_ids])
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request: forgotten here at once, its blocks freed by the core before its next step."""
        self._streams.pop(request_id, None)
        if request_id in self._beams:
            self._beams.discard(request_id)
            self._send_quietly(["abort", request_id, []])
        elif request_id in self.output_processor.requests:
            seq_ids = self.output_processor.seq_ids(request_id)
            self.output_processor.abort(request_id)
            self._send_quietly(["abort", request_id, seq_ids])

    async def add_lora(self, lora: LoRARequest) -> bool:
        """Read and check an adapter in the core between two steps; True if it was new."""
        return await self._rpc("add_lora", lora)

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self._rpc("remove_lora", lora_int_id)

    def add_lora_now(self, lora: LoRARequest) -> bool:
        """add_lora before start() (the server's --lora-modules)."""
        assert self._receiver is None, "after start(): await add_lora"
        call_id = next(self._call_ids)
        self._send(["call", call_id, "add_lora", [lora]])
        return self._recv_now("reply", call_id)

    async def kv_state(self) -> dict[str, Any]:
        """The KV pool now (each block's holder, the accounting) and its recent history, from the core."""
        return await self._rpc("kv_state")

    async def shutdown(self, timeout: float = CORE_EXIT_TIMEOUT_S) -> None:
        """Fail what is still running, stop the core (and its workers), close the sockets."""
        self._closing = True  # from here the event loop sends nothing: close() sends "shutdown" from its thread
        self._fail_all(EngineDeadError("the engine was shut down"))
        await asyncio.to_thread(self.close, timeout)

    def close(self, timeout: float = CORE_EXIT_TIMEOUT_S) -> None:
        """Stop the core process (asked to, SIGKILL after ``timeout`` s; at once while it loads) and free the
        sockets; idempotent, from any thread once the event loop no longer sends."""
        if self._closed:
            return
        self._closing = self._closed = True  # first: the receiving thread must not take this exit for a death
        if self.proc is not None and self.proc.poll() is None:
            if not self._ready:  # loading: nothing to drain (the core reads no message until it is loaded)
                self.proc.kill()
            else:
                with contextlib.suppress(zmq.ZMQError, EngineDeadError):
                    self._send(["shutdown"], timeout)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("the engine core process did not exit within %.0f s: killing it", timeout)
                self.proc.kill()
                self.proc.wait()
        if self._receiver is not None:
            self._receiver.join(timeout=2.0)
        self._to_core.close()
        self._from_core.close()
        self._ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    # ------------------------------------------------------------------ plumbing
    def _check_running(self) -> None:
        if not self.is_running:
            raise EngineDeadError("the engine is not running") from self.dead_error

    def _new_future(self) -> asyncio.Future:
        assert self._loop is not None, "start() first"
        return self._loop.create_future()

    async def _rpc(self, method: str, *args: Any) -> Any:
        self._check_running()
        call_id = next(self._call_ids)
        done = self._calls[call_id] = self._new_future()
        self._send(["call", call_id, method, list(args)])
        return await done

    def _send(self, message: list[Any] | bytes, timeout: float | None = None) -> None:
        """Send without ever blocking on a core that is gone: a bound PUSH socket with no peer (not connected
        yet, or exited) would wait forever; EngineDeadError if the core exits first, or after ``timeout`` s."""
        data = message if isinstance(message, bytes) else encode(message)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                self._to_core.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                if self.proc is None or self.proc.poll() is not None or self._core_error is not None:
                    raise EngineDeadError("the engine core process is gone") from self._core_error
                if deadline is not None and time.monotonic() > deadline:
                    raise EngineDeadError("the engine core process does not read its commands") from None
                self._to_core.poll(RECEIVE_POLL_MS, zmq.POLLOUT)

    def _send_quietly(self, message: list[Any]) -> None:
        """Send unless shutting down or dead (a stream finishing then aborts into nothing)."""
        if not self._closing and self.dead_error is None:
            with contextlib.suppress(EngineDeadError):
                self._send(message)

    def _receive(self) -> None:
        """The receiving thread: each message to the event loop; the core's exit noticed within RECEIVE_POLL_MS."""
        try:
            while not self._closed:
                if self._from_core.poll(RECEIVE_POLL_MS):
                    self._dispatch(decode(self._from_core.recv()))
                    continue
                code = self.proc.poll()
                if code is not None:
                    while self._from_core.poll(50):  # its last words (a "dead" message) first
                        self._dispatch(decode(self._from_core.recv()))
                    if not self._closing:
                        reason = f": {self._core_error}" if self._core_error else ""
                        self._die(EngineDeadError(f"the engine core process exited with status {code}{reason}"))
                    return
        except BaseException as e:  # this thread is how the server hears the core: without it, it is dead
            if not self._closing:
                logger.exception("the engine core's messages cannot be read")
                self._die(EngineDeadError(f"the engine core's messages cannot be read: {e!r}"))

    def _die(self, error: EngineDeadError) -> None:
        """Any thread: /health says 503 from now on; the event loop fails every request and calls on_dead."""
        if self.dead_error is None:
            self.dead_error = error
            self._call_soon(self._on_core_exit, error)

    def _dispatch(self, message: list[Any]) -> None:
        if message[0] == "dead":  # the core failed: nothing is sent to it any more
            self._core_error = decode_error(message[1])
            return
        self._call_soon(self._on_message, message)

    def _call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._loop is not None
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    def _on_message(self, message: list[Any]) -> None:
        if self.dead_error is not None:
            return
        try:
            self._handle(message)
        except Exception as e:  # outputs lost here would leave streams waiting: fail everything, loudly
            logger.exception("an engine core message could not be handled")
            self._die(EngineDeadError(f"an engine core message could not be handled: {e!r}"))

    def _handle(self, message: list[Any]) -> None:
        kind, *payload = message
        if kind == "outputs":
            self._on_outputs(*payload)
        elif kind == "accepted":  # counted here, in the core's order: the next statistics already include it
            request_id, error = payload
            self._queued -= 1
            self._waiting += error is None
            _resolve(self._accepting.pop(request_id, None), error, None)
        elif kind == "reply":
            call_id, error, result = payload
            _resolve(self._calls.pop(call_id, None), error, result)

    def _on_outputs(self, core_outputs: list, beam_outputs: list[RequestOutput], stats: EngineStats) -> None:
        outputs, stopped = self.output_processor.process(core_outputs)
        if stopped:
            self._send_quietly(["stop", stopped])
        for out in outputs + beam_outputs:
            if out.finished:
                self._beams.discard(out.request_id)
                stream = self._streams.pop(out.request_id, None)
            else:
                stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)
        self._stats = stats
        self._waiting = stats.num_waiting
        if self.on_step is not None:
            self.on_step(stats, self.output_processor.take_iteration_stats())

    def _on_core_exit(self, error: EngineDeadError) -> None:
        logger.error("%s", error)
        self._queued = 0
        self._fail_all(error)
        if self.on_dead is not None:
            self.on_dead(error)

    def _fail_all(self, error: BaseException) -> None:
        """Every stream ends with ``error``; every pending acceptance and call raises it."""
        for stream in self._streams.values():
            stream.put_nowait(error)
        self._streams.clear()
        for future in [*self._accepting.values(), *self._calls.values()]:
            if not future.done():
                future.set_exception(EngineDeadError(str(error)))
        self._accepting.clear()
        self._calls.clear()
        for request_id in list(self.output_processor.requests):
            self.output_processor.abort(request_id)
        self._beams.clear()


ServingEngine = AsyncLLMEngine | AsyncLLM
"""What the API server serves from: the engine loop in a thread here, or the core in its own process."""


def _resolve(future: asyncio.Future | None, error: dict[str, Any] | None, result: Any) -> None:
    """Settle a caller's future with the core's answer, unless the caller went away."""
    if future is None or future.done():
        return
    if error is not None:
        future.set_exception(decode_error(error))
    else:
        future.set_result(result)


def _encode_request(message: list[Any], params: SamplingParams | BeamSearchParams) -> bytes:
    """A request's message; a parameter msgpack cannot hold (an integer beyond 64 bits) is a ValidationError."""
    try:
        return encode(message)
    except OverflowError:
        for name, value in vars(params).items():
            try:
                encode(value)
            except OverflowError:
                raise ValidationError.bad_value(name, value, "within the 64-bit integer range") from None
        raise ValidationError("an integer in the request is beyond the 64-bit range", param="prompt") from None
