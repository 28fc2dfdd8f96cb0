"""How a front end reaches its engine core (vLLM v1's EngineCoreClient family).

- InprocClient: the core in the caller's thread, stepped by the caller (the offline LLMEngine).
- ThreadClient: the core and engine/core_loop.py's loop in a thread of this process (`pagedllm serve` with
  PAGEDLLM_ENABLE_MULTIPROCESSING=0).
- MPClient: the same loop in a child process (engine/core_proc.py), over ZeroMQ (`pagedllm serve`).

The two asynchronous ones have one interface (AsyncCoreClient): engine/async_llm.py's front end sends
engine/messages.py's records and gets the core's messages on its event loop, whichever it talks to.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from pagedllm.engine import local_core
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core import EngineCore
from pagedllm.engine.core_loop import CALLS, PAUSING_CALLS, EngineCoreLoop, QueueChannel
from pagedllm.engine.local_core import make_socket_dir, sweep_socket_dirs
from pagedllm.engine.messages import (
    PROTOCOL_VERSION,
    Abort,
    AddBeamSearch,
    AddRequest,
    Call,
    CoreDead,
    CoreMessage,
    CoreReady,
    FrontMessage,
    Reply,
    Shutdown,
    StartCore,
    StartupError,
    StepOutputs,
)
from pagedllm.engine.replica_launch import CoreProcess, Launcher, LocalLauncher
from pagedllm.engine.serial import decode, decode_error, encode
from pagedllm.errors import ValidationError
from pagedllm.models.loader import load_tokenizer, resolve_model_path

logger = logging.getLogger(__name__)

RECEIVE_POLL_MS = 200
"""How often the receiving thread checks that the core process is alive while it says nothing."""
CORE_EXIT_TIMEOUT_S = 15.0
"""A core told to shut down gets this long (its workers stop too) before it is killed (a thread: abandoned)."""


class EngineDeadError(RuntimeError):
    """The engine core stopped (it failed, or was shut down); no request can be served."""


class InprocClient:
    """The core in this thread: each call runs at once, ``step`` runs one batch."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    def add(self, request: AddRequest | AddBeamSearch) -> None:
        """Queue a tokenized request (ValidationError if the core refuses it: then nothing of it is queued)."""
        if isinstance(request, AddRequest):
            self.core.add_request(request)
        else:
            self.core.add_beam_search(request)

    def abort(self, request: Abort) -> None:
        self.core.abort(request)

    def stop(self, seq_ids: list[str]) -> None:
        self.core.stop(seq_ids)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> StepOutputs:
        return self.core.step()

    def kv_map(self, cells: bool = True) -> dict[str, Any]:
        """The KV pool now, each block's holder and the accounting (the loop's kv_state adds its history)."""
        return self.core.kv_map(cells)

    def call(self, method: str, *args: Any) -> Any:
        """One of the core's CALLS (the same set the other clients reach)."""
        if method not in CALLS or method == "kv_state":
            raise ValueError(f"the engine core has no call {method!r} here")
        result = getattr(self.core, method)(*args)
        if method in PAUSING_CALLS:  # nothing waits here (lifecycle.py refuses "wait" with requests in flight)
            assert self.core.lifecycle.try_finish()
        return result

    def shutdown(self) -> None:
        self.core.shutdown()


class AsyncCoreClient:
    """A core stepped by its own loop; messages reach the front's event loop (the same for each client)."""

    ready: CoreReady
    """What the core said once loaded."""
    tokenizer: Any
    """The front's own tokenizer (never shared with the core's thread)."""

    def start(self, on_message: Callable[[CoreMessage], None],
              on_dead: Callable[[EngineDeadError], None]) -> None:
        """Start delivering: ``on_message`` for each of the core's messages and ``on_dead`` once if it stops
        unasked, both on the running event loop (call from it)."""
        raise NotImplementedError

    def send(self, message: FrontMessage) -> None:
        """One message to the core (EngineDeadError if it is gone; ValidationError if it cannot be sent)."""
        raise NotImplementedError

    def call_now(self, method: str, args: list[Any]) -> Any:
        """One of CALLS before start() (e.g. the server's --lora-modules), waiting for its answer."""
        raise NotImplementedError

    def is_alive(self) -> bool:
        """Started, and its core still runs."""
        raise NotImplementedError

    def exit_reason(self) -> str | None:
        """Why the core is gone, when that is known before on_dead has been delivered (None: not known)."""
        return None

    def close(self, timeout: float = CORE_EXIT_TIMEOUT_S) -> None:
        """Stop the core (and its workers) and free what the client holds; idempotent, any thread."""
        raise NotImplementedError


def make_async_client(args: EngineArgs, step_log: str | None, multiprocess: bool) -> AsyncCoreClient:
    """The core in a child process (``multiprocess``) or in a thread of this one, loaded (several behind one
    client, with data parallelism: engine/dp_client.py's DPClient)."""
    return MPClient(args, step_log) if multiprocess else ThreadClient(args, step_log)


class _Delivery:
    """The event loop and callbacks a started client hands messages to (from its own thread)."""

    def __init__(self, on_message: Callable[[CoreMessage], None], on_dead: Callable[[EngineDeadError], None]) -> None:
        self.loop = asyncio.get_running_loop()
        self.on_message = on_message
        self.on_dead = on_dead

    def soon(self, fn: Callable[..., Any], *args: Any) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(fn, *args)


class ThreadClient(AsyncCoreClient):
    """The core and its loop in a thread of this process (torch releases the GIL while a step computes)."""

    def __init__(self, args: EngineArgs, step_log: str | None = None) -> None:
        self.core = EngineCore.from_engine_args(args)
        try:
            # the front's own: it tokenizes in its threads while the core's thread uses the core's (a fast
            # tokenizer's state is not shared across threads safely)
            self.tokenizer = load_tokenizer(self.core.config.model.model)
            self.ready = self.core.ready_message()
            self._channel = QueueChannel(self._deliver)
            self._loop = EngineCoreLoop(self.core, self._channel, step_log)
        except BaseException:
            self.core.shutdown()  # no worker left behind
            raise
        self._thread: threading.Thread | None = None
        self._delivery: _Delivery | None = None
        self._dead = False
        self._closed = False

    def start(self, on_message: Callable[[CoreMessage], None],
              on_dead: Callable[[EngineDeadError], None]) -> None:
        assert self._thread is None
        self._delivery = _Delivery(on_message, on_dead)
        self._thread = threading.Thread(target=self._loop.run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    def _deliver(self, message: CoreMessage) -> None:  # the loop's thread
        assert self._delivery is not None
        if isinstance(message, CoreDead):
            self._dead = True
            self._delivery.soon(self._delivery.on_dead, EngineDeadError(
                f"the engine loop stopped: {message.error.type}: {message.error.message}"))
        else:
            self._delivery.soon(self._delivery.on_message, message)

    def send(self, message: FrontMessage) -> None:
        if not self.is_alive():
            raise EngineDeadError("the engine is not running")
        self._channel.put(message)

    def call_now(self, method: str, args: list[Any]) -> Any:
        assert self._thread is None, "after start(): send a Call"
        return self._loop.call(method, args)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._dead and not self._closed

    def close(self, timeout: float = CORE_EXIT_TIMEOUT_S) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._channel.put(Shutdown())
            self._thread.join(timeout)
        self.core.shutdown()


class MPClient(AsyncCoreClient):
    """The core in a child process; a thread here receives its messages, the event loop alone sends."""

    def __init__(self, args: EngineArgs, step_log: str | None = None, launcher: Launcher | None = None,
                 index: int = 0, report_cache: bool = False, tokenizer: Any = None, wait: bool = True) -> None:
        """Start the core process (through ``launcher``: default, a child of this process; ``index``: which
        data-parallel replica it is) and wait until its engine is loaded (raises what the load raised).
        ``report_cache``: the core reports its prefix cache's changes with each step (data-parallel routing);
        ``tokenizer``: the front's, when it has one already (else loaded here while the core loads);
        ``wait`` False: return once started, call ``wait_ready()`` later (several cores load at once). A local
        core dies with the thread that started it (PR_SET_PDEATHSIG): start it from one that lives as long."""
        self._core_error: BaseException | None = None
        self._closing = False
        """Set once close() began: its exit is no death."""
        self._dead = False
        self._ready = False
        self._receiver: threading.Thread | None = None
        self._delivery: _Delivery | None = None
        self.proc: CoreProcess | None = None
        # the core `pagedllm serve` started first (engine/local_core.py): the default launcher's one core
        early = local_core.claim() if launcher is None else None
        launcher = launcher or LocalLauncher()
        # ipc:// for a core on this machine (a 0700 folder: only this user connects); tcp:// to a Ray node
        self._dir: str | None = None
        if early is not None:
            self._dir = early.folder
        elif launcher.host is None:
            sweep_socket_dirs()  # what a SIGKILLed front left behind
            self._dir = make_socket_dir()
        self._ctx = zmq.Context()
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._from_core = self._ctx.socket(zmq.PULL)
        self._call_ids = itertools.count()
        try:
            addresses = local_core.socket_addresses(self._dir) if self._dir else []
            for i, sock in enumerate((self._to_core, self._from_core)):
                sock.setsockopt(zmq.LINGER, 0)
                sock.bind(addresses[i] if self._dir else f"tcp://{launcher.host}:*")
                if not self._dir:
                    addresses.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
            self.proc = early.proc if early is not None else launcher.launch(index, addresses)
            self._send(encode(StartCore(version=PROTOCOL_VERSION, engine_args=args, step_log=step_log,
                                        report_cache=report_cache)))
            # while the core loads the model
            self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(resolve_model_path(args.model))
        except BaseException:
            self.close()
            raise
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until the core's engine is loaded (raises what the load raised, and then the core is stopped)."""
        try:
            ready = self._recv_now(CoreReady)
        except BaseException:
            self.close()
            raise
        if ready.version != PROTOCOL_VERSION:
            self.close()
            raise RuntimeError(f"the engine core speaks protocol version {ready.version}, this front "
                               f"{PROTOCOL_VERSION}")
        self.ready = ready
        # both connections are up (the core read StartCore and we read CoreReady): the socket files are no longer
        # needed, and gone now they cannot be left in the temp folder if this process is killed
        shutil.rmtree(self._dir, ignore_errors=True)
        self._dir = None
        self._ready = True

    def _recv_now(self, kind: type, call_id: int | None = None) -> Any:
        """Before start(): wait for the core's ``kind`` message (a Reply: to ``call_id``); raise what the core
        reports instead, or EngineDeadError if it exits."""
        while True:
            while not self._from_core.poll(RECEIVE_POLL_MS):
                if self.proc.poll() is not None:
                    raise EngineDeadError(f"the engine core process exited with status {self.proc.returncode}"
                                          + ("" if self._ready else " while loading")) from self._core_error
            message = decode(self._from_core.recv())
            if isinstance(message, (StartupError, CoreDead)):
                self._core_error = decode_error(message.error)
                if isinstance(message, StartupError):
                    raise self._core_error
            elif isinstance(message, kind) and kind is CoreReady:
                return message
            elif isinstance(message, kind) and message.call_id == call_id:
                if message.error is not None:
                    raise decode_error(message.error)
                return message.result

    def call_now(self, method: str, args: list[Any]) -> Any:
        assert self._receiver is None, "after start(): send a Call"
        call_id = next(self._call_ids)
        self._send(encode(Call(call_id=call_id, method=method, args=args)))
        return self._recv_now(Reply, call_id)

    def start(self, on_message: Callable[[CoreMessage], None],
              on_dead: Callable[[EngineDeadError], None]) -> None:
        assert self._receiver is None
        self._delivery = _Delivery(on_message, on_dead)
        self._receiver = threading.Thread(target=self._receive, name="pagedllm-core-receiver", daemon=True)
        self._receiver.start()

    def is_alive(self) -> bool:
        return (self._receiver is not None and self._receiver.is_alive() and not self._dead
                and not self._closing and self.proc.poll() is None)

    def exit_reason(self) -> str | None:
        # between the core's exit and on_dead (its last words are read first), a request is refused with this
        code = self.proc.poll()
        return None if code is None else f"the engine core process exited with status {code}"

    def send(self, message: FrontMessage) -> None:
        if self._closing:
            raise EngineDeadError("the engine is shut down")
        self._send(_encode_request(message) if isinstance(message, (AddRequest, AddBeamSearch)) else encode(message))

    def close(self, timeout: float = CORE_EXIT_TIMEOUT_S) -> None:
        """Stop the core process (asked to, SIGKILL after ``timeout`` s; at once while it loads) and free the
        sockets; idempotent, from any thread once the event loop no longer sends."""
        if self._closing and self._to_core.closed:
            return
        self._closing = True  # first: the receiving thread must not take this exit for a death
        if self.proc is not None and self.proc.poll() is None:
            if not self._ready:  # loading: nothing to drain (the core reads no message until it is loaded)
                self.proc.kill()
            else:
                with contextlib.suppress(zmq.ZMQError, EngineDeadError):
                    self._send(encode(Shutdown()), timeout)
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
    def _send(self, data: bytes, timeout: float | None = None) -> None:
        """Send without ever blocking on a core that is gone: a bound PUSH socket with no peer (not connected
        yet, or exited) would wait forever; EngineDeadError if the core exits first, or after ``timeout`` s."""
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

    def _receive(self) -> None:
        """The receiving thread: each message to the event loop; the core's exit noticed within RECEIVE_POLL_MS."""
        try:
            while not self._to_core.closed:
                if self._from_core.poll(RECEIVE_POLL_MS):
                    self._dispatch(decode(self._from_core.recv()))
                    continue
                code = self.proc.poll()
                if code is not None:
                    while self._from_core.poll(50):  # its last words (a CoreDead) first
                        self._dispatch(decode(self._from_core.recv()))
                    if not self._closing:
                        reason = f": {self._core_error}" if self._core_error else ""
                        self._die(EngineDeadError(f"the engine core process exited with status {code}{reason}"))
                    return
        except BaseException as e:  # this thread is how the server hears the core: without it, it is dead
            if not self._closing:
                logger.exception("the engine core's messages cannot be read")
                self._die(EngineDeadError(f"the engine core's messages cannot be read: {e!r}"))

    def _dispatch(self, message: CoreMessage) -> None:
        if isinstance(message, CoreDead):  # the core failed: nothing is sent to it any more; its exit follows
            self._core_error = decode_error(message.error)
            return
        assert self._delivery is not None
        self._delivery.soon(self._delivery.on_message, message)

    def _die(self, error: EngineDeadError) -> None:
        """Any thread: is_alive() is False from now on; the event loop hears of it once."""
        if not self._dead:
            self._dead = True
            assert self._delivery is not None
            self._delivery.soon(self._delivery.on_dead, error)


def _encode_request(message: AddRequest | AddBeamSearch) -> bytes:
    """A request's message; a parameter msgpack cannot hold (an integer beyond 64 bits) is a ValidationError."""
    try:
        return encode(message)
    except OverflowError:
        for name, value in vars(message.params).items():
            try:
                encode(value)
            except OverflowError:
                raise ValidationError.bad_value(name, value, "within the 64-bit integer range") from None
        raise ValidationError("an integer in the request is beyond the 64-bit range", param="prompt") from None
