"""Ray set-up, shared by the tensor-parallel Ray executor (executor/ray_executor.py: one actor per rank) and the
data-parallel replicas on Ray (engine/replica_launch.py: one core process per replica): join ``RAY_ADDRESS``'s
cluster or start a local one on 127.0.0.1, place one placement group and wait for room, pass the environment the
kernels read on to the actors Ray starts elsewhere, and undo all of it on close.
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from typing import Any

from pagedllm import envs
from pagedllm.errors import ValidationError

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0
"""Seconds to wait for the cluster to have room for every bundle (and for an actor to be placed)."""

FORWARDED_ENV_PREFIXES = ("PAGEDLLM_", "GLOO_", "ATEN_CPU_CAPABILITY", "ONEDNN_", "DNNL_", "MKL_ENABLE")
"""Environment variables the actors get from the engine's process (Ray starts them elsewhere)."""


def import_ray(param: str) -> Any:
    """The ``ray`` module, or a ValidationError naming the option (``param``, value "ray") that asked for it."""
    try:
        import ray
    except ImportError:
        raise ValidationError(f"{param}='ray' needs Ray: pip install 'pagedllm[ray]'", param=param,
                              value="ray") from None
    return ray


def forwarded_env(extra_prefixes: Sequence[str] = ()) -> dict[str, str]:
    """The variables of this process an actor on another node must see (FORWARDED_ENV_PREFIXES and ``extra``)."""
    prefixes = (*FORWARDED_ENV_PREFIXES, *extra_prefixes)
    return {k: v for k, v in os.environ.items() if k.startswith(prefixes)}


class RayCluster:
    """This process's hold on a Ray cluster: the connection (when this process made it) and one placement group."""

    def __init__(self, param: str, bundles: list[dict[str, float]], strategy: str, what: str,
                 failure: type[Exception] = RuntimeError) -> None:
        """Connect (unless Ray is initialized already: then the caller's connection is used and kept) and place
        ``bundles`` with ``strategy``; ``what`` words them in the error raised (as ``failure``) when the cluster
        has no room after PLACEMENT_TIMEOUT_S. ``param``: the option that asked for Ray."""
        ray = self.ray = import_ray(param)
        self.connected = False
        """This process called ray.init: close disconnects (which stops a local cluster it started)."""
        self.local = False
        """The cluster is one this process started, on 127.0.0.1."""
        self.placement_group: Any = None
        self._environ: dict[str, str] | None = None
        """The process's environment before it connected: ray.init adds to it (a local cluster's RAY_AUTH_MODE=token,
        ...), which a later connection in this process would inherit; close puts it back."""
        if not ray.is_initialized():
            self._connect(sum(b.get("CPU", 0.0) for b in bundles))
        try:
            from ray.util.placement_group import placement_group
            self.placement_group = placement_group(bundles, strategy=strategy)
            ready, _ = ray.wait([self.placement_group.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise failure(f"the Ray cluster has no room for {what} after {PLACEMENT_TIMEOUT_S:.0f} s: "
                              f"{ray.cluster_resources()}")
        except BaseException:
            self.close()
            raise

    def _connect(self, cpus: float) -> None:
        self._environ = dict(os.environ)
        address = envs.RAY_ADDRESS.read()
        if address:
            logger.info("joining the Ray cluster at %s", address)
            self.ray.init(address=address, log_to_driver=True)
        else:
            logger.info("starting a local Ray cluster (set RAY_ADDRESS to join one)")
            self.ray.init(num_cpus=max(int(cpus), os.cpu_count() or 1), include_dashboard=False, log_to_driver=True,
                          _node_ip_address="127.0.0.1")  # a local cluster listens on loopback only
            self.local = True
        self.connected = True

    def bundle(self, index: int) -> Any:
        """The scheduling strategy that puts an actor in bundle ``index`` of the placement group."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        return PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=index)

    def close(self) -> None:
        """Remove the placement group; disconnect if this process connected. Idempotent."""
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group
            with contextlib.suppress(Exception):  # the cluster is already gone
                remove_placement_group(self.placement_group)
            self.placement_group = None
        if self.connected:
            self.connected = False
            self.ray.shutdown()
        if self._environ is not None:
            for key in set(os.environ) - set(self._environ):
                del os.environ[key]
            self._environ = None
