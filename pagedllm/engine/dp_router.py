"""Which data-parallel replica takes a request (the front's side of `--data-parallel-size`).

Each replica reports after every step the blocks its prefix cache took in and evicted (their routing keys:
core/kv_cache_manager.py's ``iter_routing_keys``); the router keeps one set of keys per replica. ``prefix``
sends a request to the replica holding the longest run of its prompt's leading blocks, unless that replica has
more than ``max_imbalance`` requests beyond the least loaded one (a prefix hit saves the prefill, a queue costs
it back); ties go to the least loaded. ``least-loaded`` and ``round-robin`` ignore the caches. Load is what the
front itself sent and has not seen finish, so it is exact the moment a request is routed.
"""
from __future__ import annotations

from collections.abc import Sequence

from pagedllm.core.kv_cache_manager import iter_routing_keys

ROUTING_POLICIES = ("prefix", "least-loaded", "round-robin")
DEFAULT_MAX_IMBALANCE = 4
"""Requests a replica may hold beyond the least loaded one and still be chosen for its cached prefix."""


class Router:
    """Replica choice for each request; every method runs on the front's event loop."""

    def __init__(self, num_replicas: int, block_size: int, policy: str = "prefix",
                 max_imbalance: int = DEFAULT_MAX_IMBALANCE) -> None:
        assert policy in ROUTING_POLICIES, policy
        self.policy = policy
        self.block_size = block_size
        self.max_imbalance = max_imbalance
        self.cached: list[set[int]] = [set() for _ in range(num_replicas)]
        """Per replica, the routing keys of the blocks its prefix cache holds (as of its last report)."""
        self.load: list[int] = [0] * num_replicas
        """Per replica, requests sent and not yet finished."""
        self.alive: list[bool] = [True] * num_replicas
        self._next = 0

    def choose(self, prompt_ids: Sequence[int], salt: str | None = None) -> tuple[int, int]:
        """(replica, blocks of this prompt it holds) for a new request; raises LookupError when none is alive."""
        live = [i for i, up in enumerate(self.alive) if up]
        if not live:
            raise LookupError("no data-parallel replica is running")
        if self.policy == "round-robin":
            pick = min(live, key=lambda i: (i - self._next) % len(self.alive))
            self._next = pick + 1
            return pick, 0
        lightest = min(self.load[i] for i in live)
        eligible = [i for i in live if self.load[i] <= lightest + self.max_imbalance]
        if self.policy == "least-loaded" or not any(self.cached[i] for i in eligible):
            return self._least_loaded(live, lightest), 0
        hits = self._leading_hits(prompt_ids, salt, eligible)
        best = max(hits[i] for i in eligible)
        if best == 0:
            return self._least_loaded(live, lightest), 0
        pick = min((i for i in eligible if hits[i] == best), key=lambda i: self.load[i])
        return pick, best

    def _least_loaded(self, live: list[int], lightest: int) -> int:
        """The least loaded replica, turn by turn among equals (an idle server spreads its first requests)."""
        pick = min((i for i in live if self.load[i] == lightest), key=lambda i: (i - self._next) % len(self.alive))
        self._next = pick + 1
        return pick

    def _leading_hits(self, prompt_ids: Sequence[int], salt: str | None, replicas: list[int]) -> dict[int, int]:
        """Per replica, how many of the prompt's leading blocks it caches. Blocks are hashed one by one and only
        while some replica still holds the run (a long prompt nobody caches costs one hash, not one per block)."""
        hits = dict.fromkeys(replicas, 0)
        holding = [i for i in replicas if self.cached[i]]
        for n, key in enumerate(iter_routing_keys(prompt_ids, self.block_size, salt)):
            holding = [i for i in holding if key in self.cached[i]]
            if not holding:
                break
            for i in holding:
                hits[i] = n + 1
        return hits

    def report(self, replica: int, stored: Sequence[int], evicted: Sequence[int]) -> None:
        """A replica's cache changes of one step."""
        cached = self.cached[replica]
        cached.difference_update(evicted)
        cached.update(stored)

    def set_alive(self, replica: int, alive: bool) -> None:
        """A replica lost (nothing routed to it) or (re)started (its cache empty)."""
        self.alive[replica] = alive
        self.cached[replica] = set()
        if alive:
            self.load[replica] = 0

