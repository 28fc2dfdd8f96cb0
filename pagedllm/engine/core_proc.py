"""The engine core in its own process: `pagedllm serve` starts ``python -m pagedllm.engine.core_proc IN OUT``
(engine/core_client.py's MPClient) and the two talk over ZeroMQ with engine/messages.py's records, as bytes
(engine/serial.py). The API process tokenizes, detokenizes and serves HTTP, so JSON, tokenizers and the step
never share a GIL; this process loads the engine core and runs engine/core_loop.py's loop.

Handshake: StartCore first (its version must be PROTOCOL_VERSION), answered by CoreReady or StartupError.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal

import torch
import zmq

from pagedllm.engine.core import EngineCore
from pagedllm.engine.core_loop import EngineCoreLoop
from pagedllm.engine.messages import PROTOCOL_VERSION, CoreMessage, FrontMessage, StartCore, StartupError
from pagedllm.engine.serial import decode, encode, encode_error
from pagedllm.platform.process import exit_now

logger = logging.getLogger(__name__)


class ZmqChannel:
    """The loop's link to a front in another process: a PULL socket in, a PUSH socket out."""

    def __init__(self, commands: zmq.Socket, results: zmq.Socket) -> None:
        self.commands = commands
        self.results = results
        self._parent = os.getppid()

    def poll(self, timeout_s: float) -> bool:
        return bool(self.commands.poll(int(timeout_s * 1000)))

    def recv(self) -> FrontMessage | None:
        return decode(self.commands.recv())

    def send(self, message: CoreMessage) -> None:
        self.results.send(encode(message))

    def wake(self) -> None:  # a worker's failure is seen within the idle poll (IDLE_POLL_S)
        pass

    def front_alive(self) -> bool:
        return os.getppid() == self._parent


def _import_ahead() -> None:
    """Import now what loading the engine imports on first use: `pagedllm serve` starts this process before its
    own imports (engine/local_core.py), so this runs while the front still starts, not after StartCore. Every
    model's config or tokenizer imports transformers.activations (~1.3 s: it pulls in transformers' kernels hub)."""
    import transformers.activations  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    """The process: connect, load the engine core StartCore describes, say CoreReady, loop."""
    parser = argparse.ArgumentParser(description="pagedllm's engine core process (started by `pagedllm serve`)")
    parser.add_argument("commands", help="ZeroMQ address to read commands from")
    parser.add_argument("results", help="ZeroMQ address to send results to")
    parser.add_argument("--cores", default=None,
                        help="bind this process's threads to these cores, e.g. 0-3,8 (a data-parallel replica)")
    parser.add_argument("--threads", type=int, default=None, help="compute threads (a replica on a Ray node)")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="the pid that started this process: if it is gone by now, exit at once")
    ns = parser.parse_args(argv)
    if ns.cores:  # before torch starts its thread pool: the pool's threads inherit the affinity
        cores = [int(c) for c in ns.cores.split(",")]
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    elif ns.threads:
        torch.set_num_threads(ns.threads)
    from pagedllm.executor.multiproc import _die_with_parent
    _die_with_parent(ns.parent_pid)  # killed with the API process, whatever kills it (gone already: exit)
    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C, systemd's stop: they reach the whole group, and the
        signal.signal(sig, signal.SIG_IGN)       # API process drains its requests first, then says Shutdown
    log = logging.getLogger("pagedllm")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s (engine core): %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    ctx = zmq.Context()
    commands, results = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock, address in ((commands, ns.commands), (results, ns.results)):
        sock.setsockopt(zmq.LINGER, 2000)  # the last messages (a CoreDead) still leave at exit
        sock.connect(address)
    _import_ahead()
    try:
        try:
            start = decode(commands.recv())
            if not isinstance(start, StartCore) or start.version != PROTOCOL_VERSION:
                raise RuntimeError(f"the front speaks {getattr(start, 'version', type(start).__name__)!r}, this "
                                   f"engine core protocol version {PROTOCOL_VERSION}: same pagedllm on both sides?")
            core = EngineCore.from_engine_args(start.engine_args)
            if start.report_cache:
                core.report_cache_changes()
        except BaseException as e:
            logger.error("the engine could not start: %s", e)
            results.send(encode(StartupError(error=encode_error(e))))
            return 1
        try:
            channel = ZmqChannel(commands, results)
            loop = EngineCoreLoop(core, channel, start.step_log)
            channel.send(core.ready_message())
            return loop.run()
        finally:
            core.shutdown()
    finally:
        commands.close()
        results.close()
        ctx.term()


if __name__ == "__main__":
    exit_now(main())  # the loop, the workers and the sockets are shut down: no interpreter teardown (~1 s)
