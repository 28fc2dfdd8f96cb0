"""The server's front end (vLLM v1's AsyncLLM): tokenizes prompts, sends tokenized requests to an engine core
through a client (engine/core_client.py: a thread or a process, it does not know which), detokenizes the
core's outputs (stop strings, logprobs' text) and hands them to one stream per request.

The event loop owns every piece of state here: requests, streams, the output processor, what is sent.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from pagedllm import envs
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_client import CORE_EXIT_TIMEOUT_S, AsyncCoreClient, EngineDeadError, make_async_client
from pagedllm.engine.dp_client import DPClient
from pagedllm.engine.front_requests import FrontRequests
from pagedllm.engine.lifecycle import EnginePausedError
from pagedllm.engine.messages import (
    Abort,
    Accepted,
    AddRequest,
    Call,
    CoreMessage,
    EngineStats,
    FrontMessage,
    Reply,
    StepOutputs,
    Stop,
)
from pagedllm.engine.output_processor import IterationStats
from pagedllm.engine.processor import PromptType
from pagedllm.engine.serial import decode_error
from pagedllm.errors import ValidationError
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")
PAUSE_SETTLE_S = 0.05
"""After a pause answers: time for the streams it finished to send their last chunk first."""

#: Called on the event loop after every step (and after aborts) with fresh statistics: the stepping replica's
#: (its index the third argument; 0 without data parallelism) and the front's timings.
StepCallback = Callable[[EngineStats, IterationStats, int], None]


class AsyncLLM(FrontRequests):
    """Serves many concurrent callers from one engine core; ``add_request`` returns a RequestStream."""

    def __init__(self, client: AsyncCoreClient, on_step: StepCallback | None = None,
                 on_dead: Callable[[BaseException], None] | None = None) -> None:
        self.client = client
        self.on_step = on_step
        self.on_dead = on_dead
        """Called once (on the event loop) when the core dies: e.g. the server exits non-zero."""
        ready = client.ready
        super().__init__(client.tokenizer, ready, log_stats=True)
        self.dead_error: BaseException | None = None
        self._closing = False
        """Set once shutdown began: nothing more is sent."""
        self._stats: EngineStats = ready.stats
        self._replica_stats: dict[int, EngineStats] = {}
        """With data parallelism: each replica's statistics after its last step."""
        self._streams: dict[str, asyncio.Queue] = {}
        self._accepting: dict[str, asyncio.Future] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._started = False
        self._waiting = 0
        """Requests the core holds that have not run a step yet (as of its last statistics)."""
        self._queued = 0
        """Requests sent to the core (or tokenizing on their way) and not yet accepted or refused."""
        self._tokenizing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedllm-tokenize")
        """Where prompts are tokenized and chat templates rendered, off the event loop (HF's fast tokenizers
        release the GIL; 1,024 x 16 KB inputs held the loop for seconds). One thread, as vLLM's: requests keep
        their order, and a tokenizer's truncation settings are never changed by two callers at once."""

    @classmethod
    def from_engine_args(cls, args: EngineArgs, on_step: StepCallback | None = None,
                         on_dead: Callable[[BaseException], None] | None = None, step_log: str | None = None,
                         multiprocess: bool | None = None) -> AsyncLLM:
        """Load the engine core: in its own process unless ``multiprocess`` is False (default: from
        PAGEDLLM_ENABLE_MULTIPROCESSING); ``step_log``: the core's per-step log (`pagedllm serve --step-log`)."""
        if multiprocess is None:
            multiprocess = envs.ENABLE_MULTIPROCESSING.read()
        if args.data_parallel_size != 1:
            if not multiprocess:
                raise ValidationError(f"data_parallel_size={args.data_parallel_size} runs each replica's engine core "
                                      f"in a process of its own; {envs.ENABLE_MULTIPROCESSING.name}=0 (a core in a "
                                      "thread) cannot apply", param="data_parallel_size", value=args.data_parallel_size)
            return cls(DPClient(args, step_log), on_step, on_dead)
        return cls(make_async_client(args, step_log, multiprocess), on_step, on_dead)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start receiving the core's messages on this event loop; call from it."""
        assert not self._started
        self._started = True
        self.client.start(self._on_message, self._on_core_dead)

    @property
    def is_running(self) -> bool:
        return self._started and self.dead_error is None and not self._closing and self.client.is_alive()

    @property
    def num_waiting(self) -> int:
        """Requests accepted or on their way that have not run a step yet (what load shedding counts)."""
        return self._waiting + self._queued

    async def shutdown(self, timeout: float = CORE_EXIT_TIMEOUT_S) -> None:
        """Fail what is still running, stop the core (and its workers)."""
        self._closing = True
        self._fail_all(EngineDeadError("the engine was shut down"))
        await asyncio.to_thread(self.close, timeout)

    def close(self, timeout: float = CORE_EXIT_TIMEOUT_S) -> None:
        """Stop the core and its workers; idempotent, from any thread once the event loop no longer sends."""
        self._closing = True
        self.client.close(timeout)
        self._tokenizing.shutdown(wait=False, cancel_futures=True)

    async def in_tokenizer_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the tokenizer thread (see ``_tokenizing``), awaited from the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, fn, *args)

    # ------------------------------------------------------------------ requests
    def get_stats(self) -> EngineStats:
        """The core's counters after its last step (with data parallelism: every replica's, summed)."""
        return self._stats

    @property
    def data_parallel_size(self) -> int:
        """Engine replicas behind this front."""
        return self.config.parallel.data_parallel_size

    def replica_states(self, details: bool = True) -> list[dict[str, Any]] | None:
        """With data parallelism: per replica, whether it runs, its load and restarts (``details``: also its
        process and place); else None."""
        states = getattr(self.client, "replica_states", None)
        return states(details) if states is not None else None

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | BeamSearchParams,
                          arrival_time: float | None = None, lora_request: LoRARequest | None = None
                          ) -> RequestStream:
        """Tokenize and send a request (a beam search with BeamSearchParams; with a LoRA adapter:
        ``lora_request``); returns its output stream once the core accepted it (ValidationError if refused)."""
        self._check_running()
        self._check_new_id(request_id, self._accepting)
        accepted = self._accepting[request_id] = asyncio.get_running_loop().create_future()  # (the id is taken)
        self._queued += 1  # waiting from now: load shedding counts it while it tokenizes (until its Accepted)
        sent, seq_ids = False, []
        try:
            text, request = await self.in_tokenizer_thread(self._core_request, request_id, prompt, params,
                                                           arrival_time, lora_request)
            seq_ids = request.seq_ids if isinstance(request, AddRequest) else []
            stream = RequestStream(self, request_id)
            self._check_running()  # (the engine may have died while this request was tokenized)
            self.client.send(request)
            sent = True
            self._track(request_id, text, request)
            self._streams[request_id] = stream.queue
            await accepted
        except BaseException as e:
            self._undo_add(request_id, accepted, sent, seq_ids, e)
            raise
        return stream

    def _undo_add(self, request_id: str, accepted: asyncio.Future, sent: bool, seq_ids: list[str],
                  error: BaseException) -> None:
        """Forget a request whose add failed (refused, the engine dead, the caller gone); one the core may hold
        (sent, and not refused by it) is aborted there."""
        if not sent and self.dead_error is None:
            self._queued -= 1  # no Accepted will come for it
        if accepted.done() and not accepted.cancelled():
            accepted.exception()  # (retrieved: a dead engine's error is raised otherwise)
        self._streams.pop(request_id, None)
        self._accepting.pop(request_id, None)
        self._untrack(request_id)
        if sent and not isinstance(error, ValidationError):  # e.g. the client went away: the core may have it
            self._send_quietly(Abort(request_id=request_id, seq_ids=seq_ids))

    async def generate(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """``add_request`` and iterate its outputs in one call."""
        stream = await self.add_request(request_id, prompt, params, arrival_time)
        async for out in stream:
            yield out

    def abort(self, request_id: str) -> None:
        """Abort a request: forgotten here at once, its blocks freed by the core before its next step."""
        self._streams.pop(request_id, None)
        abort = self._forget(request_id)
        if abort is not None:
            self._send_quietly(abort)

    # ------------------------------------------------------------------ calls between steps
    async def add_lora(self, lora: LoRARequest) -> bool:
        """Read and check an adapter in the core between two steps; True if it was new."""
        return await self._call("add_lora", lora)

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self._call("remove_lora", lora_int_id)

    async def list_loras(self) -> set[int]:
        """The ids of the adapters the core holds."""
        return set(await self._call("list_loras"))

    def add_lora_now(self, lora: LoRARequest) -> bool:
        """add_lora before start() (the server's --lora-modules)."""
        assert not self._started, "after start(): await add_lora"
        return self.client.call_now("add_lora", [lora])

    # ------------------------------------------------------------------ RL controls (engine/lifecycle.py)
    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause generation (vLLM's): returns once the pause completed ("wait": the running requests finished)."""
        await self._call("pause", mode, clear_cache)
        await self._after_pause(mode)

    async def resume_generation(self) -> None:
        await self._call("resume")

    async def is_paused(self) -> bool:
        return await self._call("is_paused")

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Pause, then release the KV pool (level 1) and the weights (level 2); new requests wait for wake_up."""
        await self._call("sleep", level, mode)
        await self._after_pause(mode)

    async def release_kv_cache_memory(self) -> None:
        """vLLM's: release the KV cache (what runs is aborted; new requests wait), the weights kept; wake_up with
        ["kv_cache"] brings it back."""
        await self._call("release_kv_cache_memory")
        await self._after_pause("abort")

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back what sleep released (None: all); True once the engine is fully awake (and serving)."""
        return await self._call("wake_up", tags)

    async def is_sleeping(self) -> bool:
        return await self._call("is_sleeping")

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]:
        """``method(*args, **kwargs)`` on every worker, results in rank order (TimeoutError after ``timeout``
        seconds; the call itself runs to its end)."""
        call = self._call("collective_rpc", method, list(args), kwargs)
        return await (call if timeout is None else asyncio.wait_for(call, timeout))

    async def _after_pause(self, mode: str) -> None:
        """The beam searches an "abort" ended fail (they have no finish of their own); a moment for the streams
        the abort finished to send their last chunk before the caller hears the pause is done (as vLLM)."""
        if mode == "abort":
            for request_id in list(self._beams):
                self._beams.discard(request_id)
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream.put_nowait(EnginePausedError("the beam search was aborted by a pause"))
        await asyncio.sleep(PAUSE_SETTLE_S)

    async def kv_state(self) -> dict[str, Any]:
        """The KV pool now (each block's holder, the accounting) and its recent history, from the core."""
        return await self._call("kv_state")

    async def _call(self, method: str, *args: Any) -> Any:
        self._check_running()
        call_id = next(self._call_ids)
        done = self._calls[call_id] = asyncio.get_running_loop().create_future()
        self.client.send(Call(call_id=call_id, method=method, args=list(args)))
        return await done

    # ------------------------------------------------------------------ the core's messages (event loop)
    def _check_running(self) -> None:
        if not self.is_running:
            reason = self.client.exit_reason() if self.dead_error is None else str(self.dead_error)
            why = "" if reason is None else f": {reason}"  # why it stopped, said once
            raise EngineDeadError(f"the engine is not running{why}") from self.dead_error

    def _send_quietly(self, message: FrontMessage) -> None:
        """Send unless shutting down or dead (a stream finishing then aborts into nothing)."""
        if not self._closing and self.dead_error is None:
            with contextlib.suppress(EngineDeadError):
                self.client.send(message)

    def _on_message(self, message: CoreMessage) -> None:
        if self.dead_error is not None:
            return
        try:
            if isinstance(message, StepOutputs):
                self._on_outputs(message)
            elif isinstance(message, Accepted):  # counted here, in the core's order: its next statistics have it
                self._queued -= 1
                self._waiting += message.error is None
                _resolve(self._accepting.pop(message.request_id, None), message.error, None)
            elif isinstance(message, Reply):
                _resolve(self._calls.pop(message.call_id, None), message.error, message.result)
        except Exception as e:  # outputs lost here would leave streams waiting: fail everything, loudly
            logger.exception("an engine core message could not be handled")
            self._on_core_dead(EngineDeadError(f"an engine core message could not be handled: {e!r}"))

    def _on_outputs(self, message: StepOutputs) -> None:
        outputs, stopped = self.output_processor.process(message.outputs)
        if stopped:
            self._send_quietly(Stop(seq_ids=stopped))
        for out in outputs + message.beam_outputs:
            if out.finished:
                self._beams.discard(out.request_id)
                stream = self._streams.pop(out.request_id, None)
            else:
                stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)
        if self.data_parallel_size > 1:
            self._replica_stats[message.engine_index] = message.stats
            self._stats = EngineStats.combine(list(self._replica_stats.values()))
        else:
            self._stats = message.stats
        self._waiting = self._stats.num_waiting
        if self.on_step is not None:
            self.on_step(message.stats, self.output_processor.take_iteration_stats(), message.engine_index)

    def _on_core_dead(self, error: EngineDeadError) -> None:
        if self.dead_error is not None:
            return
        self.dead_error = error
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


class RequestStream:
    """The outputs of one request, in order; leaving the iteration early aborts the request."""

    def __init__(self, engine: AsyncLLM, request_id: str) -> None:
        self.engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self.queue.get()
                if isinstance(item, EnginePausedError):
                    raise item
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


def _resolve(future: asyncio.Future | None, error: Any, result: Any) -> None:
    """Settle a caller's future with the core's answer, unless the caller went away."""
    if future is None or future.done():
        return
    if error is not None:
        future.set_exception(decode_error(error))
    else:
        future.set_result(result)
