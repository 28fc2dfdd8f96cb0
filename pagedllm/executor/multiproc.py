"""One worker process per rank on this machine (``distributed_executor_backend="mp"``): tensor-parallel ranks, or
pipeline stages (distributed/pipeline.py).

Workers are started with spawn and join a gloo group through a TCP store on 127.0.0.1. Each
step's SchedulerOutput is pickled once and the same bytes are written to every worker's pipe
(pipes, not a shared-memory ring: measured in docs/BENCHMARKS.md, "Tensor parallelism"); only
the rank that samples (rank 0; with pipeline stages, the last stage's first) answers a step. A
worker that dies, raises or stops answering fails the engine with an error naming its rank, and
every worker is stopped; a worker whose engine process is gone exits on its own (EOF on its
pipe, and the kernel's parent-death signal).
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from pagedllm.config import EngineConfig, ParallelConfig
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.executor.base import EXECUTE_TIMEOUT_ENV, Executor, WorkerError, execute_timeout, process_stopped
from pagedllm.models.config import ArchConfig
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.platform.process import exit_now

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
"""Seconds a worker may take to load its shard (and build the kernels on a fresh machine)."""
POLL_S = 0.5
"""How often a wait checks that no worker is stopped (SIGSTOP, a debugger)."""
_SHUTDOWN = "__shutdown__"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class _WorkerHandle:
    rank: int
    process: Any  # multiprocessing's SpawnProcess
    commands: Connection  # engine -> worker
    results: Connection  # worker -> engine


def _core_share(parallel: ParallelConfig, rank: int, batches_in_flight: int) -> tuple[int, int]:
    """(index, of how many) among the ranks splitting this machine's cores: a stage's tensor-parallel ranks, where
    one batch at a time goes through the stages (they share the cores); every rank, where several batches are in
    flight (every stage computes at once)."""
    if batches_in_flight > 1:
        return rank, parallel.world_size
    return rank % parallel.tensor_parallel_size, parallel.tensor_parallel_size


class MultiprocExecutor(Executor):
    """N local worker processes, one per rank; the engine's process only schedules."""

    def __init__(self, config: EngineConfig, arch: ArchConfig, eos_token_ids: tuple[int, ...]) -> None:
        from pagedllm.worker.worker import RankInfo  # the engine process itself loads no model code
        self._timeout = execute_timeout()  # read once: a step's deadline
        world = config.parallel.world_size
        self._answering = config.parallel.answering_rank  # the rank that samples: the last pipeline stage's first
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        level = logging.getLogger("pagedllm").getEffectiveLevel()
        super().__init__()
        # one machine: stages in flight at once would split the cores and the memory bandwidth one batch at a time
        # uses whole (SmolLM2-1.7B shape, pp=2 on 2 cores: 67.9 tok/s with 2 in flight, 82.4 with 1)
        self.batches_in_flight = config.parallel.batches_in_flight or 1
        self._closing = False
        self.workers: list[_WorkerHandle] = []
        for rank in range(world):
            cmd_read, cmd_write = ctx.Pipe(duplex=False)
            res_read, res_write = ctx.Pipe(duplex=False)
            info = RankInfo(rank=rank, local_rank=rank, local_world_size=world, distributed_init_method=init_method,
                            core_share=_core_share(config.parallel, rank, self.batches_in_flight))
            proc = ctx.Process(target=_worker_main, name=f"pagedllm-worker-{rank}", daemon=True,
                               args=(config, arch, eos_token_ids, info, cmd_read, res_write, level))
            proc.start()
            cmd_read.close()  # the child's ends: ours closed, so EOF reaches whoever outlives the other
            res_write.close()
            self.workers.append(_WorkerHandle(rank, proc, cmd_write, res_read))
        self._finalizer = weakref.finalize(self, _stop_workers, self.workers)
        try:
            self._collect(range(world), STARTUP_TIMEOUT_S, "start")
        except BaseException:
            self.shutdown()
            raise
        self._monitor = threading.Thread(target=self._watch, name="pagedllm-worker-monitor", daemon=True)
        self._monitor.start()

    # --------------------------------------------------------------- calls
    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        self._broadcast(method, args, reply=True)
        results = self._collect(range(len(self.workers)), self._timeout, method)
        return [results[rank] for rank in range(len(self.workers))]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit_model(scheduler_output)
        return self.collect_model()

    def submit_model(self, scheduler_output: SchedulerOutput) -> None:
        # every worker reads its pipe in order; only the answering rank writes, one answer per step, in order
        self._broadcast("execute_model", (scheduler_output,), reply=False)

    def collect_model(self) -> ModelRunnerOutput:
        return self._collect((self._answering,), self._timeout, "execute_model")[self._answering]

    def shutdown(self) -> None:
        self._closing = True
        self._finalizer()

    # --------------------------------------------------------------- plumbing
    def _broadcast(self, method: str, args: tuple, reply: bool) -> None:
        """One pickle, the same bytes to every worker (nothing per rank is serialized twice)."""
        if self.failure is not None:
            raise self.failure
        data = pickle.dumps((method, args, reply), protocol=pickle.HIGHEST_PROTOCOL)
        for w in self.workers:
            try:
                w.commands.send_bytes(data)
            except OSError:  # broken pipe: the worker is gone
                self._fail(self._death(w))

    def _collect(self, ranks: Any, timeout: float, what: str) -> dict[int, Any]:
        """Wait for the answers of ``ranks``, watching every worker: any error, death or stop fails."""
        want = set(ranks)
        results: dict[int, Any] = {}
        by_conn = {w.results: w for w in self.workers}
        by_sentinel = {w.process.sentinel: w for w in self.workers}
        deadline = time.monotonic() + timeout
        while want - results.keys():
            left = deadline - time.monotonic()
            if left <= 0:
                late = sorted(want - results.keys())
                self._fail(WorkerError(f"worker rank {late[0]} did not answer {what!r} within {timeout:.0f} s "
                                       f"(set {EXECUTE_TIMEOUT_ENV} to allow more)", late[0]))
            ready = wait([*by_conn, *by_sentinel], timeout=min(left, POLL_S))
            for obj in ready:
                if obj in by_conn:  # answers first: a dying worker may have reported why
                    w = by_conn[obj]
                    try:
                        status, value = obj.recv()
                    except (EOFError, OSError):
                        self._fail(self._death(w))
                    if status == "error":
                        self._fail(WorkerError(f"worker rank {w.rank} failed in {what!r}:\n{value}", w.rank))
                    results[w.rank] = value
            for obj in ready:
                if obj in by_sentinel and not by_sentinel[obj].results.poll():
                    self._fail(self._death(by_sentinel[obj]))
            if not ready:
                for w in self.workers:
                    if process_stopped(w.process.pid):
                        self._fail(WorkerError(f"worker rank {w.rank} (pid {w.process.pid}) stopped answering: "
                                               "its process is stopped", w.rank))
        return results

    def _death(self, w: _WorkerHandle) -> WorkerError:
        w.process.join(timeout=1.0)
        code = w.process.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return WorkerError(f"worker rank {w.rank} (pid {w.process.pid}) {how}", w.rank)

    def _kill_workers(self) -> None:
        _kill_workers(self.workers)  # the pipes stay open until shutdown: a wait in another thread sees EOFs

    def _watch(self) -> None:
        """Between steps too: a worker that dies fails the engine at once."""
        sentinels = {w.process.sentinel: w for w in self.workers}
        ready = wait(list(sentinels))
        if self._closing or self.failure is not None:
            return
        with contextlib.suppress(WorkerError):
            self._fail(self._death(sentinels[ready[0]]))


def _stop_workers(workers: list[_WorkerHandle]) -> None:
    """Ask every worker to exit, then terminate and kill whatever is left; close the pipes."""
    for w in workers:
        with contextlib.suppress(OSError):
            w.commands.send_bytes(pickle.dumps((_SHUTDOWN, (), False)))
    deadline = time.monotonic() + 5.0
    for w in workers:
        w.process.join(timeout=max(0.0, deadline - time.monotonic()))
    _kill_workers(workers)
    for w in workers:
        w.commands.close()
        w.results.close()


def _kill_workers(workers: list[_WorkerHandle]) -> None:
    """SIGTERM, then SIGKILL, every worker still alive; reap them."""
    for w in workers:
        if w.process.is_alive():
            w.process.terminate()
    for w in workers:
        w.process.join(timeout=2.0)
        if w.process.is_alive():
            w.process.kill()
            w.process.join(timeout=2.0)


# ------------------------------------------------------------------- in the worker process
def _worker_main(config: EngineConfig, arch: ArchConfig, eos_token_ids: tuple[int, ...], info: Any,
                 commands: Connection, results: Connection, log_level: int) -> None:
    """A worker process: load this rank's shard, then run what the engine sends until told to stop (a step's
    result sent by the answering rank alone)."""
    parent = mp.parent_process()
    _die_with_parent(parent.pid if parent is not None else None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the engine decides
    setup_worker_logging(info.rank, log_level)
    from pagedllm.worker.extension import make_worker
    try:
        worker = make_worker(config, arch, eos_token_ids, info)
    except BaseException:
        results.send(("error", traceback.format_exc()))
        return
    results.send(("ok", None))
    try:
        while True:
            try:
                method, args, reply = pickle.loads(commands.recv_bytes())
            except (EOFError, OSError):
                break  # the engine is gone
            if method == _SHUTDOWN:
                break
            try:
                value = getattr(worker, method)(*args)
            except BaseException:
                results.send(("error", traceback.format_exc()))
                continue
            if reply or info.rank == config.parallel.answering_rank:
                results.send(("ok", value))
    finally:
        worker.shutdown()
    exit_now(0)  # shut down: no interpreter teardown (~1 s the engine's shutdown waited on per worker)


def _die_with_parent(parent: int | None = None) -> None:
    """Linux: SIGKILL this process when the engine's process dies (even by SIGKILL). ``parent``: the pid that
    started this one; if it is no longer the parent (it died while this process was importing, before the
    signal was asked for, so none will come), exit now rather than live on as an orphan."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def setup_worker_logging(rank: int, level: int) -> None:
    """pagedllm's log lines of a worker process, at the engine's level, marked with the rank."""
    log = logging.getLogger("pagedllm")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"%(levelname)s %(name)s [rank {rank}]: %(message)s"))
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False
