"""One Ray actor per rank (tensor-parallel ranks, pipeline stages), on any number of machines
(``distributed_executor_backend="ray"``).

The actors run the same ``Worker`` as the multiprocess executor. They are placed by a placement
group with one bundle per rank (``PAGEDLLM_RAY_PLACEMENT_STRATEGY``: PACK by default, SPREAD or
STRICT_SPREAD to put ranks on different machines); the gloo group's store listens on rank 0's
node IP. With ``RAY_ADDRESS`` set the engine joins that cluster, otherwise it starts a local one
(and stops it on shutdown). Each step's SchedulerOutput is pickled once and every actor gets
those bytes. docs/DISTRIBUTED.md shows a multi-machine set-up.
"""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import threading
import time
from typing import Any

from pagedllm import envs
from pagedllm.config import EngineConfig, ParallelConfig
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.distributed.ray_cluster import RayCluster, forwarded_env
from pagedllm.executor.base import EXECUTE_TIMEOUT_ENV, Executor, WorkerError, execute_timeout, process_stopped
from pagedllm.models.config import ArchConfig
from pagedllm.outputs import ModelRunnerOutput

logger = logging.getLogger(__name__)

STRATEGY_ENV = envs.RAY_PLACEMENT_STRATEGY.name
"""Placement-group strategy of the rank bundles: PACK (default), SPREAD, STRICT_PACK or STRICT_SPREAD."""
STARTUP_TIMEOUT_S = 600.0
"""Seconds the actors may take to load their shards."""
POLL_S = 0.5


class RayWorker:
    """The Ray actor around a Worker (created empty: the rank is known once every actor is placed)."""

    def __init__(self, log_level: int) -> None:
        self.worker: Any = None
        self.rank = -1
        self.answers = False
        """It is the rank whose step results the scheduler takes (ParallelConfig.answering_rank)."""
        self.log_level = log_level

    def node(self) -> tuple[str, str, int]:
        """(node id, node IP, pid) of this actor."""
        import ray
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def free_memory(self) -> int:
        """What this actor's node can still give (config.py ``available_memory_bytes``)."""
        from pagedllm.config import available_memory_bytes
        return available_memory_bytes()

    def free_port(self) -> int:
        """A free TCP port on this actor's node (rank 0 hosts the gloo store there)."""
        import ray

        from pagedllm.executor.multiproc import free_port
        return free_port(ray.util.get_node_ip_address())

    def init_worker(self, config: EngineConfig, arch: ArchConfig, eos_token_ids: tuple[int, ...], info: Any) -> None:
        from pagedllm.executor.multiproc import setup_worker_logging
        from pagedllm.worker.extension import make_worker
        setup_worker_logging(info.rank, self.log_level)
        self.rank = info.rank
        self.answers = info.rank == config.parallel.answering_rank
        self.worker = make_worker(config, arch, eos_token_ids, info)

    def execute_method(self, method: str, reply: bool, args: bytes) -> Any:
        """Run ``Worker.<method>(*pickle.loads(args))``; the answering rank (or every rank with ``reply``) answers."""
        value = getattr(self.worker, method)(*pickle.loads(args))
        return value if reply or self.answers else None

    def watch(self) -> None:
        """Never returns while the actor lives: the engine's monitor learns of its death through it."""
        threading.Event().wait()


def _batches_in_flight(parallel: ParallelConfig, nodes: list[str]) -> int:
    """ParallelConfig.batches_in_flight, else pipeline_parallel_size where no two stages share a node (each
    computes on its own machines), else 1 (stages on one machine take turns on its cores)."""
    if parallel.batches_in_flight is not None:
        return parallel.batches_in_flight
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    stages_of = {}
    for rank, node in enumerate(nodes):
        stages_of.setdefault(node, set()).add(rank // tp)
    return pp if all(len(stages) == 1 for stages in stages_of.values()) else 1


class RayDistributedExecutor(Executor):
    """N Ray actors, one per rank, in one placement group."""

    def __init__(self, config: EngineConfig, arch: ArchConfig, eos_token_ids: tuple[int, ...]) -> None:
        from pagedllm.worker.memory_fit import check_nodes  # (each node's ranks against its memory, before loading)
        from pagedllm.worker.worker import RankInfo
        world, tp = config.parallel.world_size, config.parallel.tensor_parallel_size
        self._answering = config.parallel.answering_rank
        strategy = envs.RAY_PLACEMENT_STRATEGY.read()
        self._timeout = execute_timeout()  # read once: a step's deadline
        super().__init__()
        self._closing = False
        self.actors: list[Any] = []
        self.pids: list[int] = []  # of each rank's actor process
        self.node_ids: list[str] = []  # of each rank's Ray node
        self.cluster = RayCluster("distributed_executor_backend", [{"CPU": 1.0} for _ in range(world)], strategy,
                                  f"{world} bundles of 1 CPU ({strategy})", WorkerError)
        ray = self.ray = self.cluster.ray
        try:
            env = forwarded_env()
            actor_cls = ray.remote(num_cpus=1, concurrency_groups={"watch": 1})(RayWorker)
            level = logging.getLogger("pagedllm").getEffectiveLevel()
            self.actors = [actor_cls.options(
                scheduling_strategy=self.cluster.bundle(rank), runtime_env={"env_vars": env}).remote(level)
                for rank in range(world)]
            nodes = ray.get([a.node.remote() for a in self.actors], timeout=STARTUP_TIMEOUT_S)
            self.pids = [pid for _, _, pid in nodes]
            port = ray.get(self.actors[0].free_port.remote())
            init_method = f"tcp://{nodes[0][1]}:{port}"  # rank 0's node: the other machines reach it there
            self.batches_in_flight = _batches_in_flight(config.parallel, [n for n, _, _ in nodes])
            infos = []
            for rank, (node_id, _, _) in enumerate(nodes):
                same = [r for r, (n, _, _) in enumerate(nodes) if n == node_id]
                # its stage's ranks here split the cores (every rank here, with several batches in flight)
                at_once = [r for r in same if r // tp == rank // tp or self.batches_in_flight > 1]
                infos.append(RankInfo(rank=rank, local_rank=same.index(rank), local_world_size=len(same),
                                      distributed_init_method=init_method,
                                      core_share=(at_once.index(rank), len(at_once))))
            logger.info("Ray actors: %s", ", ".join(f"rank {r} on {ip} (pid {pid})"
                                                    for r, (_, ip, pid) in enumerate(nodes)))
            self.node_ids = [n for n, _, _ in nodes]
            free = ray.get([a.free_memory.remote() for a in self.actors], timeout=STARTUP_TIMEOUT_S)
            check_nodes(config, arch, [(f"{ip} ({node[:8]})", f) for (node, ip, _), f in zip(nodes, free)])
            self._wait([a.init_worker.remote(config, arch, eos_token_ids, info)
                        for a, info in zip(self.actors, infos)], STARTUP_TIMEOUT_S, "start")
        except BaseException:
            self.shutdown()
            raise
        self._watch_refs = [a.watch.options(concurrency_group="watch").remote() for a in self.actors]
        self._monitor = threading.Thread(target=self._watch, name="pagedllm-ray-monitor", daemon=True)
        self._monitor.start()

    # --------------------------------------------------------------- calls
    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return self._call(method, args, reply=True)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit_model(scheduler_output)
        return self.collect_model()

    def submit_model(self, scheduler_output: SchedulerOutput) -> None:
        self._answers.append(self._send("execute_model", (scheduler_output,), reply=False))  # each actor in order

    def collect_model(self) -> ModelRunnerOutput:
        return self._wait(self._answers.popleft(), self._timeout, "execute_model")[self._answering]

    def shutdown(self) -> None:
        """Kill the actors, remove the placement group; if this engine called ray.init, disconnect (which
        stops a local cluster it started; a cluster it joined keeps running)."""
        if self._closing:
            return
        self._closing = True
        self._kill_workers()
        self.cluster.close()

    # --------------------------------------------------------------- plumbing
    def _call(self, method: str, args: tuple, reply: bool) -> list[Any]:
        return self._wait(self._send(method, args, reply), self._timeout, method)

    def _send(self, method: str, args: tuple, reply: bool) -> list[Any]:
        """Start ``method`` on every actor; the refs of their answers, in rank order."""
        if self.failure is not None:
            raise self.failure
        # pickled once; every actor gets the same bytes (cheaper than ray.put for a step's few KB: measured)
        data = pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)
        return [a.execute_method.remote(method, reply, data) for a in self.actors]

    def _wait(self, refs: list[Any], timeout: float, what: str) -> list[Any]:
        """Every rank's result, in rank order; any rank's error or death fails the engine at once."""
        ray = self.ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                rank = rank_of[pending[0]]
                self._fail(WorkerError(f"worker rank {rank} did not answer {what!r} within {timeout:.0f} s "
                                       f"(set {EXECUTE_TIMEOUT_ENV} to allow more)", rank))
            # all at once (one call per step); a rank that failed is in `ready` after at most POLL_S
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=min(left, POLL_S))
            if not ready:
                self._check_stopped()
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._fail(WorkerError(f"worker rank {rank} (Ray actor, pid {self._pid(rank)}) died: {e}", rank))
                except ray.exceptions.RayTaskError as e:
                    self._fail(WorkerError(f"worker rank {rank} failed in {what!r}:\n{e}", rank))
            if self.failure is not None:
                raise self.failure
        return [results[rank] for rank in range(len(refs))]

    def _check_stopped(self) -> None:
        """Actors on this machine whose process is stopped cannot answer: fail now, not at the timeout."""
        here = self.ray.get_runtime_context().get_node_id()
        for rank, (node_id, pid) in enumerate(zip(self.node_ids, self.pids)):
            if node_id == here and process_stopped(pid):
                self._fail(WorkerError(f"worker rank {rank} (Ray actor, pid {pid}) stopped answering: its process "
                                       "is stopped", rank))

    def _pid(self, rank: int) -> Any:
        return self.pids[rank] if self.pids else "?"

    def _kill_workers(self) -> None:
        for actor in self.actors:
            with contextlib.suppress(Exception):
                self.ray.kill(actor)

    def _watch(self) -> None:
        """A ``watch`` call ends only when its actor dies: then the engine fails, even between steps."""
        ray = self.ray
        with contextlib.suppress(Exception):
            ready, _ = ray.wait(self._watch_refs, num_returns=1)
            if self._closing or self.failure is not None:
                return
            rank = self._watch_refs.index(ready[0])
            with contextlib.suppress(WorkerError):
                self._fail(WorkerError(f"worker rank {rank} (Ray actor, pid {self._pid(rank)}) died", rank))
