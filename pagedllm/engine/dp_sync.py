"""Offline data parallelism (``LLM(data_parallel_size=N)``): engine/dp_client.py's replicas behind the interface
the offline engine steps (InprocClient's: add, abort, stop, step, call), so LLM.generate spreads its prompts over
the replicas and still returns outputs in input order.

The DPClient lives on an event loop in a thread of its own; its replicas run their own step loops. ``step()``
waits for the next outputs of any replica and returns all that arrived, as one StepOutputs.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
from typing import Any

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.engine.dp_client import DPClient
from pagedllm.engine.messages import (
    Abort,
    Accepted,
    AddBeamSearch,
    AddRequest,
    Call,
    CoreMessage,
    EngineStats,
    FrontMessage,
    Reply,
    StepOutputs,
    Stop,
)
from pagedllm.engine.serial import decode_error

CALL_TIMEOUT_S = 600.0
"""The longest a call (an adapter read on every replica) may take."""


class SyncDPClient:
    """InprocClient's interface over N replica processes; see the module docstring."""

    def __init__(self, args: EngineArgs) -> None:
        self.dp = DPClient(args)  # the cores start from this thread (they die with the thread that started them)
        self.ready = self.dp.ready
        self.tokenizer = self.dp.tokenizer
        self._inbox: queue.Queue = queue.Queue()
        self._open: dict[str, set[str]] = {}
        """Request id -> samples not finished (a beam search: empty, it ends with its output). Kept here, not read
        from the DPClient's own: this one changes only as step() hands outputs over, so a request is never
        finished before its last output was returned."""
        self._seq_request: dict[str, str] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._dead: BaseException | None = None
        self._refused: BaseException | None = None
        """A refusal that came with outputs: step() returned those and raises this next."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pagedllm-dp-front", daemon=True)
        self._thread.start()
        try:
            self._run(self._start())
        except BaseException:
            self.shutdown()
            raise

    async def _start(self) -> None:
        self.dp.start(self._on_message, self._on_dead)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(CALL_TIMEOUT_S)

    async def _send(self, message: FrontMessage) -> None:
        self.dp.send(message)

    # ------------------------------------------------------------------ the loop thread
    def _on_message(self, message: CoreMessage) -> None:
        if isinstance(message, Reply):
            future = self._calls.pop(message.call_id, None)
            if future is not None:
                if message.error is not None:
                    future.set_exception(decode_error(message.error))
                else:
                    future.set_result(message.result)
        else:
            self._inbox.put(message)

    def _on_dead(self, error: EngineDeadError) -> None:
        self._inbox.put(error)
        self._dead = error  # before failing the calls: a call made from now on raises at once
        for call_id in list(self._calls):
            future = self._calls.pop(call_id, None)
            if future is not None and not future.done():
                future.set_exception(error)

    # ------------------------------------------------------------------ InprocClient's interface
    def add(self, request: AddRequest | AddBeamSearch) -> None:
        """Send a tokenized request to a replica (the replica's refusal raises from the next step())."""
        self._check()
        seqs = set(request.seq_ids) if isinstance(request, AddRequest) else set()
        self._open[request.request_id] = seqs
        for seq_id in seqs:
            self._seq_request[seq_id] = request.request_id
        try:
            self._run(self._send(request))
        except BaseException:
            self._close_request(request.request_id)
            raise

    def abort(self, request: Abort) -> None:
        if request.request_id in self._open:
            self._close_request(request.request_id)
            if self._dead is None:
                self._run(self._send(request))

    def stop(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self._seq_finished(seq_id)
        if self._dead is None:
            self._run(self._send(Stop(seq_ids=seq_ids)))

    def has_unfinished_requests(self) -> bool:
        return bool(self._open) or self._refused is not None

    def step(self) -> StepOutputs:
        """The outputs of every replica step since the last call (waits for at least one while requests run).
        A replica's refusal of a request raises here (after the outputs that came with it were returned)."""
        self._check()
        if self._refused is not None:
            refused, self._refused = self._refused, None
            raise refused
        if not self._open and self._inbox.empty():
            return StepOutputs(outputs=[], beam_outputs=[], stats=EngineStats())
        items = [self._inbox.get()]
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        outputs, beams, stats, refused = [], [], {}, None
        for item in items:
            if isinstance(item, BaseException):
                self._dead = item
            elif isinstance(item, Accepted):
                if item.error is not None and item.request_id in self._open:  # else: aborted since
                    self._close_request(item.request_id)
                    refused = refused or decode_error(item.error)
            elif isinstance(item, StepOutputs):
                outputs.extend(item.outputs)
                beams.extend(item.beam_outputs)
                stats[item.engine_index] = item.stats
                for out in item.outputs:
                    if out.finished:
                        self._seq_finished(out.request_id)
                for beam in item.beam_outputs:
                    if beam.finished:
                        self._close_request(beam.request_id)
        if refused is not None:
            if not outputs and not beams:
                raise refused
            self._refused = refused  # the next call raises it: these outputs are not lost
        self._check()
        combined = EngineStats.combine(list(stats.values())) if stats else EngineStats()
        return StepOutputs(outputs=outputs, beam_outputs=beams, stats=combined)

    def call(self, method: str, *args: Any) -> Any:
        """One of the core's CALLS on every replica (their answers combined as engine/dp_client.py does)."""
        self._check()
        call_id = next(self._call_ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls[call_id] = future
        self._run(self._send(Call(call_id=call_id, method=method, args=list(args))))
        if self._dead is not None and not future.done():  # the replicas died while it was being sent
            raise EngineDeadError(str(self._dead)) from self._dead
        return future.result(CALL_TIMEOUT_S)

    def kv_map(self, cells: bool = True) -> dict[str, Any]:
        """The KV pools now: every live replica's map under "replicas" (with its "index")."""
        return self.call("kv_state")

    def replica_states(self, details: bool = True) -> list[dict[str, Any]]:
        """Per replica: whether it runs, its load and restarts (``details``: its process and place)."""
        return self.dp.replica_states(details)

    def shutdown(self) -> None:
        """Stop every replica and the loop thread; idempotent."""
        self.dp.close()
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()

    # ------------------------------------------------------------------ bookkeeping
    def _check(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead)) from self._dead

    def _seq_finished(self, seq_id: str) -> None:
        request_id = self._seq_request.pop(seq_id, None)
        seqs = self._open.get(request_id) if request_id is not None else None
        if seqs is not None:
            seqs.discard(seq_id)
            if not seqs:
                del self._open[request_id]

    def _close_request(self, request_id: str) -> None:
        for seq_id in self._open.pop(request_id, ()):
            self._seq_request.pop(seq_id, None)
