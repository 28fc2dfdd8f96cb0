"""Where an engine core process runs (engine/core_client.py's MPClient starts it through a launcher).

- LocalLauncher: a child process of this one (`pagedllm serve`, and each replica of
  ``--data-parallel-backend mp``, bound to its share of this machine's cores).
- RayLauncher: a child process of a Ray actor, one placement-group bundle per data-parallel replica, on
  whichever node has room (``--data-parallel-backend ray``); it joins ``RAY_ADDRESS`` or starts a local cluster.

Either way the process is ``python -m pagedllm.engine.core_proc`` and speaks ZeroMQ to the front: over ipc://
locally, over tcp:// to the front's node address on Ray. The process dies with its parent (the front, or the
actor), so killing either leaves nothing behind.
"""
from __future__ import annotations

import logging
import os
import subprocess
from typing import Any, Protocol

from pagedllm.distributed.ray_cluster import PLACEMENT_TIMEOUT_S, RayCluster, forwarded_env
from pagedllm.engine.local_core import CORE_MODULE, core_command

logger = logging.getLogger(__name__)


class CoreProcess(Protocol):
    """A started engine core process (subprocess.Popen's part of it that MPClient uses)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None:
        """Its exit status, or None while it runs."""

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status once it exits (subprocess.TimeoutExpired after ``timeout`` s)."""

    def kill(self) -> None:
        """SIGKILL it."""


class Launcher(Protocol):
    """Starts replica ``index``'s core process."""

    host: str | None
    """The address its core connects to (tcp://HOST), or None for ipc:// (same machine)."""

    def launch(self, index: int, argv: list[str]) -> CoreProcess:
        """Start the core with these arguments (its ZeroMQ addresses) for replica ``index``."""

    def describe(self, index: int) -> dict[str, Any]:
        """Where replica ``index`` runs (for /health)."""

    def close(self) -> None:
        """Free what the launcher holds (placement group, the Ray connection it made); idempotent."""


def split_cores(num_replicas: int, cores: list[int] | None = None) -> list[list[int]]:
    """This process's cores split evenly between ``num_replicas`` replicas (a replica's tensor-parallel ranks then
    split its share); more replicas than cores share them round-robin."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    if len(cores) < num_replicas:
        return [[cores[i % len(cores)]] for i in range(num_replicas)]
    per = len(cores) // num_replicas
    return [cores[i * per:(i + 1) * per] for i in range(num_replicas)]


def cores_spec(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "0,1,2,5" (core_proc's --cores)."""
    return ",".join(map(str, cores))


class LocalLauncher:
    """Core processes as children of this one; with ``cores``, replica i bound to ``cores[i]``."""

    host = None

    def __init__(self, cores: list[list[int]] | None = None) -> None:
        self.cores = cores

    def launch(self, index: int, argv: list[str]) -> subprocess.Popen:
        extra = ["--cores", cores_spec(self.cores[index])] if self.cores else []
        return subprocess.Popen([*core_command(argv), *extra])

    def describe(self, index: int) -> dict[str, Any]:
        return {"backend": "mp", "cores": self.cores[index] if self.cores else None}

    def close(self) -> None:
        pass


class CoreHost:
    """The Ray actor that holds a replica's bundle and runs its core process as a child (which dies with it)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def node(self) -> tuple[str, str]:
        """(node id, node IP) of this actor."""
        import ray
        return ray.get_runtime_context().get_node_id(), node_address(ray)

    def start(self, argv: list[str]) -> int:
        """Start the core; its pid."""
        self.proc = subprocess.Popen(core_command(argv))
        return self.proc.pid

    def wait(self) -> int:
        """The core's exit status, once it exits (runs beside the actor's other calls)."""
        assert self.proc is not None
        return self.proc.wait()


def node_address(ray: Any) -> str:
    """The address the Ray cluster knows this process's node by (127.0.0.1 for a local cluster)."""
    here = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == here:
            return node["NodeManagerAddress"]
    return ray.util.get_node_ip_address()


class RayCoreProcess:
    """A core process under a CoreHost actor, seen as a CoreProcess: its exit is the end of the actor's wait()
    (or the actor's death)."""

    def __init__(self, ray: Any, actor: Any, pid: int) -> None:
        self.ray, self.actor, self.pid = ray, actor, pid
        self.returncode: int | None = None
        self._done = actor.wait.remote()

    def poll(self) -> int | None:
        if self.returncode is None:
            ready, _ = self.ray.wait([self._done], timeout=0)
            if ready:
                self._settle()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            ready, _ = self.ray.wait([self._done], timeout=timeout)
            if not ready:
                raise subprocess.TimeoutExpired(CORE_MODULE, timeout or 0.0)
            self._settle()
        assert self.returncode is not None
        return self.returncode

    def _settle(self) -> None:
        try:
            self.returncode = self.ray.get(self._done)
        except Exception:  # the actor (or its node) died: its core died with it
            self.returncode = -9
        self.ray.kill(self.actor)  # its bundle is free for a restarted replica

    def kill(self) -> None:
        self.ray.kill(self.actor)  # the core process dies with the actor (core_proc dies with its parent)
        self.wait()


class RayLauncher:
    """One CoreHost actor per replica, in one placement group of ``num_replicas`` bundles of ``cpus`` CPUs each
    (SPREAD: replicas on different nodes where there is room)."""

    def __init__(self, num_replicas: int, cpus: float) -> None:
        self.cluster = RayCluster("data_parallel_backend", [{"CPU": cpus} for _ in range(num_replicas)], "SPREAD",
                                  f"{num_replicas} replicas of {cpus:g} CPU")
        self.ray = ray = self.cluster.ray
        self.nodes: dict[int, tuple[str, str]] = {}
        try:
            # the cores connect here: loopback when this process started a one-machine cluster, else the address
            # the cluster knows this node by
            self.host = "127.0.0.1" if self.cluster.local else node_address(ray)
        except BaseException:
            self.close()
            raise
        self.cpus = cpus
        env = forwarded_env(("LD_PRELOAD", "OMP_"))  # a core process runs the kernels itself: its allocator, threads
        self._actor_class = ray.remote(CoreHost)
        self._actor_options = {"num_cpus": cpus, "max_concurrency": 4, "runtime_env": {"env_vars": env}}

    def launch(self, index: int, argv: list[str]) -> RayCoreProcess:
        strategy = self.cluster.bundle(index)
        actor = self._actor_class.options(scheduling_strategy=strategy, **self._actor_options).remote()
        try:
            # bounded: a bundle whose node is gone waits for Ray to place it again
            self.nodes[index] = self.ray.get(actor.node.remote(), timeout=PLACEMENT_TIMEOUT_S)
            pid = self.ray.get(actor.start.remote([*argv, "--threads", str(max(1, int(self.cpus)))]),
                               timeout=PLACEMENT_TIMEOUT_S)
        except BaseException:
            self.ray.kill(actor)
            raise
        return RayCoreProcess(self.ray, actor, pid)

    def describe(self, index: int) -> dict[str, Any]:
        node_id, ip = self.nodes.get(index, ("", ""))
        return {"backend": "ray", "node_id": node_id, "node_ip": ip, "cpus": self.cpus}

    def close(self) -> None:
        self.cluster.close()
