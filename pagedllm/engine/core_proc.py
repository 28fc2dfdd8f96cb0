"""The engine core process: the scheduler, the KV cache manager and the model, stepping in a loop.

`pagedllm serve` starts it (``python -m pagedllm.engine.core_proc IN OUT``) and talks to it over two
ZeroMQ sockets with msgpack messages (engine/serial.py); the API process tokenizes, detokenizes and
serves HTTP, so JSON, tokenizers and the step never share a GIL. Messages, API -> core:

    ["start", EngineArgs, step_log]                 once, first
    ["add", request_id, seq_ids, prompt_ids, SamplingParams, arrival_time, cache_salt, LoRARequest]
    ["beam", request_id, text, prompt_ids, BeamSearchParams, arrival_time, LoRARequest]
    ["abort", request_id, seq_ids]                  ["stop", seq_ids]   (ended by a stop string)
    ["call", call_id, method, args]                 (CALLS)             ["shutdown"]

core -> API: ["ready", info] or ["startup_error", error]; then ["accepted", request_id, error],
["outputs", [EngineCoreOutput], [finished beam searches' RequestOutput], EngineStats] after each step
(and after aborts), ["reply", call_id, error, result], and ["dead", error] before a failed exit.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import signal
import time
from typing import Any

import zmq

from pagedllm.engine.async_engine import KVHistory
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.processor import Processor
from pagedllm.engine.serial import decode, encode, encode_error
from pagedllm.errors import ValidationError

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000
"""An idle core wakes at least this often: to sample the KV pool and notice a dead parent."""
PREPARE_POLL_MS = 5
"""While a request is being prepared and nothing runs, the core looks for its end this often."""
CALLS = ("add_lora", "remove_lora", "list_loras", "kv_state", "rank_memory_usage")
"""What the API process may call between steps (by name: nothing else can be run)."""


class EngineCore:
    """One LLMEngine stepped in a loop, fed and read through two ZeroMQ sockets."""

    def __init__(self, engine: LLMEngine, commands: zmq.Socket, results: zmq.Socket, step_log: str | None) -> None:
        self.engine = engine
        self.commands = commands
        self.results = results
        self.step_log = None if step_log is None else open(step_log, "a", buffering=1)
        self.stop = False
        self.worker_failure: BaseException | None = None
        self.kv_history = KVHistory()
        self._parent = os.getppid()
        self._preparing: dict[str, tuple[concurrent.futures.Future, str, list[Any]]] = {}
        """Requests whose preparation runs in ``_prepare_pool`` (by request id, in arrival order)."""
        # one thread: a heavy request's grammar compile takes one core, never the step's share of the rest
        self._prepare_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedllm-prepare")
        engine.executor.register_failure_callback(self._on_worker_failure)

    def _on_worker_failure(self, error: BaseException) -> None:  # any thread: the loop raises it
        self.worker_failure = error

    def run(self) -> int:
        """Step until told to stop (0), or until the engine fails or the API process is gone (1)."""
        try:
            while not self.stop:
                if self.worker_failure is not None:
                    raise self.worker_failure
                if os.getppid() != self._parent:
                    logger.error("the API server's process is gone: the engine core stops")
                    return 1
                self._admit_prepared()
                busy = self.engine.has_unfinished_requests()
                if not busy:
                    self.kv_history.sample(self.engine)
                    # a request being prepared is looked at again soon; otherwise sleep until a command comes
                    if not self.commands.poll(PREPARE_POLL_MS if self._preparing else IDLE_POLL_MS):
                        continue
                self._apply_commands()
                if not self.stop and self.engine.has_unfinished_requests():
                    self._step()
            return 0
        except BaseException as e:  # the API process answers 503 and fails its requests
            logger.exception("engine core died")
            self._send(["dead", encode_error(e)])
            return 1
        finally:
            self._prepare_pool.shutdown(wait=False, cancel_futures=True)
            if self.step_log is not None:
                self.step_log.close()

    def _step(self) -> None:
        start = time.perf_counter()
        core_outputs, beam_outputs = self.engine.step_core()
        if self.step_log is not None:  # the step as served: HTTP and clients share the machine
            self.step_log.write(json.dumps({"features": self.engine.last_step_features,
                                            "seconds": time.perf_counter() - start}) + "\n")
        self._send(["outputs", core_outputs, beam_outputs, self.engine.get_stats()])
        self.kv_history.sample(self.engine)

    def _apply_commands(self) -> None:
        aborted = False
        while not self.stop and self.commands.poll(0):
            try:
                kind, *args = decode(self.commands.recv())
            except Exception:  # one malformed message must not stop everyone's requests
                logger.exception("an engine core command could not be read (skipped)")
                continue
            if kind == "add" or kind == "beam":
                self._add(kind, args)
            elif kind == "abort":
                self._cancel_preparing(args[0])
                self.engine.abort_seqs(args[0], args[1])
                aborted = True
            elif kind == "stop":
                self.engine.stop_seqs(args[0])
                aborted = True
            elif kind == "call":
                self._call(*args)
            elif kind == "shutdown":
                self.stop = True
            else:
                raise ValueError(f"unknown engine core message {kind!r}")
        if aborted:  # gauges drop at once, not at the next step
            self._send(["outputs", [], [], self.engine.get_stats()])

    def _add(self, kind: str, args: list[Any]) -> None:
        """Queue a request, or first prepare it in the preparation thread (its grammar, its bad words) when
        that has work: the loop keeps stepping the others meanwhile."""
        params = args[3] if kind == "add" else None
        if Processor.needs_preparation(params) and args[0] not in self._preparing:
            self._preparing[args[0]] = (self._prepare_pool.submit(self.engine.processor.prepare, params), kind, args)
            return
        self._queue(kind, args)

    def _queue(self, kind: str, args: list[Any]) -> None:
        request_id = args[0]
        try:
            if kind == "add":
                self.engine.add_tokenized(*args[1:])
            else:
                self.engine.add_beam_tokenized(*args)
        except Exception as e:  # refused (400) or failed (500): this request alone, the loop goes on
            if not isinstance(e, ValidationError):
                logger.warning("request %s could not be queued: %r", request_id, e, exc_info=True)
            self.engine.abort_seqs(request_id, args[1] if kind == "add" else [])  # nothing of it left behind
            self._send(["accepted", request_id, encode_error(e)])
            return
        self._send(["accepted", request_id, None])

    def _admit_prepared(self) -> None:
        """Queue the requests whose preparation finished (or answer its error), in the order they came."""
        for request_id, (future, kind, args) in list(self._preparing.items()):
            if not future.done():
                continue
            del self._preparing[request_id]
            error = future.exception()
            if error is not None:
                self._send(["accepted", request_id, encode_error(error)])
            else:
                self._queue(kind, args)

    def _cancel_preparing(self, request_id: str) -> None:
        """An abort of a request still being prepared: it is never queued (its caller is told, for the count)."""
        entry = self._preparing.pop(request_id, None)
        if entry is not None:
            entry[0].cancel()
            self._send(["accepted", request_id, encode_error(ValidationError("the request was aborted while it "
                                                                             "was being prepared"))])

    def _call(self, call_id: int, method: str, args: list[Any]) -> None:
        try:
            if method not in CALLS:
                raise ValueError(f"the engine core has no call {method!r}")
            result = self.kv_state() if method == "kv_state" else getattr(self.engine, method)(*args)
        except Exception as e:  # the caller gets it (a monitoring call must not stop the loop)
            self._send(["reply", call_id, encode_error(e), None])
            return
        self._send(["reply", call_id, None, list(result) if isinstance(result, set) else result])

    def kv_state(self) -> dict[str, Any]:
        """The /kv page's data: each block now and the accounting's recent history."""
        return {**self.engine.kv_map(), "history": self.kv_history.points()}

    def _send(self, message: list[Any]) -> None:
        self.results.send(encode(message))


def main(argv: list[str] | None = None) -> int:
    """The process: connect, load the engine the "start" message describes, say ready, loop."""
    parser = argparse.ArgumentParser(description="pagedllm's engine core process (started by `pagedllm serve`)")
    parser.add_argument("commands", help="ZeroMQ address to read commands from")
    parser.add_argument("results", help="ZeroMQ address to send results to")
    ns = parser.parse_args(argv)
    from pagedllm.executor.multiproc import _die_with_parent
    _die_with_parent()  # killed with the API process, whatever kills it
    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C, systemd's stop: they reach the whole group, and the
        signal.signal(sig, signal.SIG_IGN)       # API process drains its requests first, then says "shutdown"
    log = logging.getLogger("pagedllm")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s (engine core): %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    ctx = zmq.Context()
    commands, results = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock, address in ((commands, ns.commands), (results, ns.results)):
        sock.setsockopt(zmq.LINGER, 2000)  # the last messages (a "dead" one) still leave at exit
        sock.connect(address)
    try:
        kind, args, step_log = decode(commands.recv())
        assert kind == "start", kind
        try:
            engine = LLMEngine.from_engine_args(args)
        except BaseException as e:
            logger.error("the engine could not start: %s", e)
            results.send(encode(["startup_error", encode_error(e)]))
            return 1
        try:
            core = EngineCore(engine, commands, results, step_log)
            results.send(encode(["ready", {"config": engine.config, "vocab_size": engine.processor.vocab_size,
                                           "eos_token_ids": list(engine.processor.eos_token_ids),
                                           "num_kv_blocks": engine.num_kv_blocks, "stats": engine.get_stats()}]))
            return core.run()
        finally:
            engine.shutdown()
    finally:
        commands.close()
        results.close()
        ctx.term()


if __name__ == "__main__":
    raise SystemExit(main())
