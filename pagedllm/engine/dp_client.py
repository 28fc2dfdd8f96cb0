"""Data parallelism behind one front (``--data-parallel-size N``): N engine cores, each a process with its own KV
pool, scheduler and tensor-parallel group, reached through one AsyncCoreClient, so the front (engine/async_llm.py)
and the server do not change.

- Each replica is an MPClient: a child process bound to its share of the cores (``mp``), or a child of a Ray
  actor in a placement-group bundle (``ray``, engine/replica_launch.py). They load in parallel.
- A new request goes where engine/dp_router.py says (its prefix cached, its load bounded); its aborts and stops
  follow it there. Each replica reports its prefix cache's changes with every step.
- Calls go to every live replica: ``kv_state`` answers one map per replica, LoRA adapters are added to all.
- A lost replica fails only its own requests: those with nothing streamed yet are sent again to another replica;
  the others end with an error output (a 500 or an error event, the server stays up). The router stops sending
  to it; with ``data_parallel_restart`` it is started again (Ray places it where there is room). The front is
  dead only when every replica is.

Everything here runs on the front's event loop, except loading and restarting replicas (worker threads).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable
from functools import partial
from typing import Any

from pagedllm.engine.arg_resolve import parallel_layout
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_client import CORE_EXIT_TIMEOUT_S, AsyncCoreClient, EngineDeadError, MPClient
from pagedllm.engine.dp_router import Router
from pagedllm.engine.messages import (
    Abort,
    Accepted,
    AddBeamSearch,
    AddRequest,
    Call,
    CoreError,
    CoreMessage,
    EngineStats,
    FrontMessage,
    Reply,
    StepOutputs,
    Stop,
)
from pagedllm.engine.replica_launch import Launcher, LocalLauncher, RayLauncher, split_cores
from pagedllm.models.loader import load_tokenizer, resolve_model_path
from pagedllm.outputs import EngineCoreOutput, RequestOutput
from pagedllm.request import block_hash_salt

logger = logging.getLogger(__name__)

MAX_RETRIES = 1
"""Times a request with nothing streamed yet is sent again after its replica was lost."""
RESTART_ATTEMPTS = 3
"""With data_parallel_restart: a replica that fails to start this many times in a row stays stopped."""
RESTART_BACKOFF_S = 5.0
"""Seconds before the second attempt (twice that before the third)."""


@dataclasses.dataclass
class _Routed:
    """A request the front sent and has not seen finish: where it is and what is needed to send it again."""

    message: AddRequest | AddBeamSearch
    replica: int
    open_seqs: set[str]
    """Samples not finished (a beam search: none; it ends with its one output)."""
    accepted: bool = False
    """Its Accepted was handed to the front (a resent request's second one is not)."""
    streamed: bool = False
    """An output of it reached the front: it cannot be sent again."""
    retries: int = 0


@dataclasses.dataclass
class _FanOut:
    """A Call sent to several replicas: their answers, until every one has answered or is gone."""

    call_id: int
    method: str
    waiting: set[int]
    results: dict[int, Any] = dataclasses.field(default_factory=dict)
    error: CoreError | None = None


class DPClient(AsyncCoreClient):
    """N replicas behind one AsyncCoreClient; see the module docstring."""

    def __init__(self, args: EngineArgs, step_log: str | None = None,
                 replica_factory: Callable[[int], MPClient] | None = None) -> None:
        """Start every replica and wait until all are loaded (they load at once); if one fails, stop the others
        and raise its error. ``replica_factory``: index -> a started, not yet ready client (tests' fakes)."""
        self.parallel = parallel_layout(args)
        n = self.parallel.data_parallel_size
        self.replica_args = dataclasses.replace(args, data_parallel_size=1)
        self.step_log = step_log
        self.tokenizer = load_tokenizer(resolve_model_path(args.model))  # once, shared by the replicas' clients
        self.launcher: Launcher
        self._factory = replica_factory or self._start_replica
        if replica_factory is not None:
            self.launcher = LocalLauncher()
        elif self.parallel.data_parallel_backend == "ray":
            self.launcher = RayLauncher(n, float(max(1, len(split_cores(n)[0]))))
        else:
            self.launcher = LocalLauncher(split_cores(n))
        # every core is started from this one thread, which lives as long as the client: a local core dies with
        # the thread that started it (PR_SET_PDEATHSIG), and a restart's start and load stay off the event loop
        self._spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedllm-dp-spawner")
        self.replicas: list[MPClient | None] = [None] * n
        self._loading: dict[int, MPClient] = {}
        """Replicas being started again (close() stops them too)."""
        self._loras: dict[int, Any] = {}
        """Adapters added through this client (by id): a restarted replica gets them again."""
        self.lost: dict[int, str] = {}
        """Replica -> why it stopped (until it is started again)."""
        self.restarts = [0] * n
        self._failed_restarts = [0] * n
        """Restarts of each replica that failed in a row (RESTART_ATTEMPTS of them: it stays stopped)."""
        self._closing = False
        self._delivery: tuple[Callable[[CoreMessage], None], Callable[[EngineDeadError], None]] | None = None
        """The front's callbacks (start())."""
        self._routed: dict[str, _Routed] = {}
        self._seq_request: dict[str, str] = {}
        """Sample id -> its request's id."""
        self._fanouts: dict[tuple[int, int], _FanOut] = {}
        """(replica, the call id it was sent) -> the front's call."""
        self._sub_ids = 0
        self._restarting: set[int] = set()
        self._stats: list[EngineStats] = []
        self._dead = False
        self._start_all(n)

    def _start_all(self, n: int) -> None:
        """Start every replica, then wait for all to load (at once); if one fails, stop the others and raise its
        error. Then the combined readiness (the KV blocks of all) and the router."""
        try:  # all start, then all load at once
            for i in range(n):
                self.replicas[i] = self._spawner.submit(self._factory, i).result()
            for replica in self._live():
                replica.wait_ready()
        except BaseException:
            for replica in self._live():
                replica.close()
            self.launcher.close()
            self._spawner.shutdown(wait=False)
            raise
        self._all_ready(n)

    def _all_ready(self, n: int) -> None:
        """Every replica loaded: the combined readiness (the KV blocks of all), the statistics, the router."""
        first = self.replicas[0]
        assert first is not None
        self.ready = dataclasses.replace(first.ready, config=dataclasses.replace(first.ready.config,
                                                                                parallel=self.parallel),
                                         num_kv_blocks=sum(r.ready.num_kv_blocks for r in self._live()),
                                         stats=EngineStats.combine([r.ready.stats for r in self._live()]))
        self._stats = [r.ready.stats for r in self._live()]
        self.router = Router(n, first.ready.config.cache.block_size, self.parallel.data_parallel_routing)

    def _start_replica(self, index: int) -> MPClient:
        log = None if self.step_log is None else f"{self.step_log}.dp{index}"
        return MPClient(self.replica_args, log, self.launcher, index, report_cache=True, tokenizer=self.tokenizer,
                        wait=False)

    def _live(self) -> list[MPClient]:
        return [r for r in self.replicas if r is not None]

    # ------------------------------------------------------------------ AsyncCoreClient
    def start(self, on_message: Callable[[CoreMessage], None],
              on_dead: Callable[[EngineDeadError], None]) -> None:
        self._delivery = (on_message, on_dead)
        for i, replica in enumerate(self.replicas):
            assert replica is not None
            replica.start(partial(self._on_message, i), partial(self._on_replica_dead, i))

    def call_now(self, method: str, args: list[Any]) -> Any:
        if method == "add_lora" and args:
            self._loras[args[0].lora_int_id] = args[0]
        results = [r.call_now(method, args) for r in self._live()]
        return results[0]

    def is_alive(self) -> bool:
        return not self._dead and not self._closing and any(r.is_alive() for r in self._live())

    def send(self, message: FrontMessage) -> None:
        if self._closing or self._dead:
            raise EngineDeadError("the engine is shut down" if self._closing else "no data-parallel replica runs")
        if isinstance(message, (AddRequest, AddBeamSearch)):
            self._route(message)
        elif isinstance(message, Abort):
            routed = self._routed.get(message.request_id)
            if routed is not None:
                self._forget(message.request_id)
                self._send_to(routed.replica, message)
        elif isinstance(message, Stop):
            by_replica: dict[int, list[str]] = {}
            for seq_id in message.seq_ids:
                request_id = self._seq_request.get(seq_id)
                routed = self._routed.get(request_id) if request_id is not None else None
                if routed is not None:
                    by_replica.setdefault(routed.replica, []).append(seq_id)
                    self._seq_done(request_id, seq_id)
            for replica, seq_ids in by_replica.items():
                self._send_to(replica, Stop(seq_ids=seq_ids))
        elif isinstance(message, Call):
            self._fan_out(message)
        else:
            for i, replica in enumerate(self.replicas):
                if replica is not None and i not in self.lost:
                    self._send_to(i, message)

    def close(self, timeout: float = CORE_EXIT_TIMEOUT_S) -> None:
        if self._closing and not self._live():
            return
        self._closing = True
        replicas, self.replicas = self._live() + list(self._loading.values()), [None] * len(self.replicas)
        with concurrent.futures.ThreadPoolExecutor(max(1, len(replicas))) as pool:
            list(pool.map(lambda r: r.close(timeout), replicas))
        self._spawner.shutdown(wait=True, cancel_futures=True)  # a restart's load ends at once: its core is gone
        self.launcher.close()

    # ------------------------------------------------------------------ what the server shows
    def replica_states(self, details: bool = True) -> list[dict[str, Any]]:
        """Per replica: whether it serves (or is starting again), why not, its load and restarts; with
        ``details`` also its process id and where it runs (not for /health, which anyone may read)."""
        states = []
        for i, replica in enumerate(self.replicas):
            up = replica is not None and i not in self.lost and replica.is_alive()
            status = "running" if up else "starting" if i in self._restarting else "stopped"
            state: dict[str, Any] = {"index": i, "status": status, "requests": self.router.load[i],
                                     "restarts": self.restarts[i]}
            if details:
                state.update(pid=replica.proc.pid if replica and replica.proc else None, **self.launcher.describe(i))
            if not up:  # the reason arrives on the event loop just after the process is seen gone
                state["error"] = self.lost.get(i, "its engine core process exited")
            states.append(state)
        return states

    # ------------------------------------------------------------------ routing
    def _route(self, message: AddRequest | AddBeamSearch, routed: _Routed | None = None) -> None:
        salt = block_hash_salt(getattr(message, "cache_salt", None), message.lora_request,
                               getattr(message, "prompt_embeds", None))
        try:
            replica, _ = self.router.choose(message.prompt_ids, salt)
        except LookupError:
            raise EngineDeadError("no data-parallel replica is running") from None
        if routed is None:
            seqs = set(message.seq_ids) if isinstance(message, AddRequest) else set()
            routed = self._routed[message.request_id] = _Routed(message, replica, seqs)
            for seq_id in seqs:
                self._seq_request[seq_id] = message.request_id
        while True:
            routed.replica = replica
            self.router.load[replica] += 1
            try:
                self._send_to(replica, message)
                return
            except EngineDeadError:  # its process exited a moment ago (its death is on its way): another one
                self.router.load[replica] -= 1
                self.router.alive[replica] = False
                try:
                    replica, _ = self.router.choose(message.prompt_ids, salt)
                except LookupError:
                    self._forget(message.request_id)
                    raise EngineDeadError("no data-parallel replica is running") from None
            except BaseException:
                self._forget(message.request_id)
                raise

    def _send_to(self, replica: int, message: FrontMessage) -> None:
        client = self.replicas[replica]
        if client is None or replica in self.lost:
            return  # its requests are being failed or moved already
        client.send(message)

    def _forget(self, request_id: str) -> None:
        routed = self._routed.pop(request_id, None)
        if routed is None:
            return
        self.router.load[routed.replica] = max(0, self.router.load[routed.replica] - 1)
        seqs = routed.message.seq_ids if isinstance(routed.message, AddRequest) else []
        for seq_id in seqs:
            self._seq_request.pop(seq_id, None)

    def _seq_done(self, request_id: str, seq_id: str) -> None:
        routed = self._routed.get(request_id)
        if routed is not None:
            routed.open_seqs.discard(seq_id)
            if not routed.open_seqs:
                self._forget(request_id)

    # ------------------------------------------------------------------ the replicas' messages (event loop)
    def _deliver(self, message: CoreMessage) -> None:
        assert self._delivery is not None
        self._delivery[0](message)

    def _on_message(self, replica: int, message: CoreMessage) -> None:
        if replica in self.lost:
            return  # a last message from a replica already given up: its requests are handled
        if isinstance(message, StepOutputs):
            self.router.report(replica, message.cache_stored, message.cache_evicted)
            for out in message.outputs:
                request_id = self._seq_request.get(out.request_id)
                if request_id is not None:
                    self._routed[request_id].streamed = True
                    if out.finished:
                        self._seq_done(request_id, out.request_id)
            for beam in message.beam_outputs:
                if beam.finished:
                    self._forget(beam.request_id)
            self._stats[replica] = message.stats
            message.engine_index = replica
            self._deliver(message)
        elif isinstance(message, Accepted):
            routed = self._routed.get(message.request_id)
            if routed is not None and routed.accepted:  # sent again after its first replica was lost: the front
                if message.error is not None:           # has its Accepted, so a refusal ends its stream instead
                    failed: list[EngineCoreOutput] = []
                    beams: list[RequestOutput] = []
                    self._fail(message.request_id, routed, f"its replica stopped and replica {replica} refused it: "
                               f"{message.error.message}", failed, beams)
                    self._deliver(StepOutputs(outputs=failed, beam_outputs=beams, stats=self._stats[replica],
                                              engine_index=replica))
                return
            if message.error is not None:
                self._forget(message.request_id)
            elif routed is not None:
                routed.accepted = True
            self._deliver(message)
        elif isinstance(message, Reply):
            fan = self._fanouts.pop((replica, message.call_id), None)
            if fan is not None:
                fan.waiting.discard(replica)
                if message.error is not None:
                    fan.error = fan.error or message.error
                else:
                    fan.results[replica] = message.result
                self._settle(fan)
        else:
            self._deliver(message)

    def _on_replica_dead(self, replica: int, error: EngineDeadError) -> None:
        if self._closing or replica in self.lost:
            return
        why = str(error)
        logger.error("data-parallel replica %d stopped: %s", replica, why)
        self.lost[replica] = why
        self.router.set_alive(replica, False)
        for key in [k for k in self._fanouts if k[0] == replica]:
            fan = self._fanouts.pop(key)
            fan.waiting.discard(replica)
            self._settle(fan)
        failed: list[EngineCoreOutput] = []
        beams: list[RequestOutput] = []
        for request_id, routed in [(k, r) for k, r in self._routed.items() if r.replica == replica]:
            if not routed.streamed and routed.retries < MAX_RETRIES and any(self.router.alive):
                routed.retries += 1
                logger.warning("request %s moves to another replica (replica %d stopped before it streamed)",
                               request_id, replica)
                try:
                    self._route(routed.message, routed)
                    continue
                except Exception as e:  # the other replica could not take it either: it fails below
                    logger.warning("request %s could not move: %s", request_id, e)
            self._fail(request_id, routed, f"the data-parallel replica serving it stopped ({why})", failed, beams)
        self.router.load[replica] = 0  # what it held has moved or failed
        self._stats[replica] = dataclasses.replace(self._stats[replica], num_running=0, num_waiting=0,
                                                   kv_cache_usage=0.0)
        if failed or beams:
            self._deliver(StepOutputs(outputs=failed, beam_outputs=beams, stats=self._stats[replica],
                                      engine_index=replica))
        if self.parallel.data_parallel_restart and not self._closing:
            self._restart(replica)
        self._check_any_left(why)

    def _fail(self, request_id: str, routed: _Routed, why: str, failed: list[EngineCoreOutput],
              beams: list[RequestOutput]) -> None:
        """End a request with an error output (and its Accepted first if the front still waits for it)."""
        if not routed.accepted:
            self._deliver(Accepted(request_id=request_id, error=CoreError(type="EngineDeadError", message=why)))
        elif isinstance(routed.message, AddBeamSearch):
            beams.append(RequestOutput(request_id=request_id, prompt=routed.message.text,
                                       prompt_token_ids=routed.message.prompt_ids, outputs=[], finished=True,
                                       error=why))
        else:
            failed.extend(EngineCoreOutput(request_id=seq_id, new_token_ids=[], finish_reason="error", error=why)
                          for seq_id in routed.open_seqs)
        self._forget(request_id)

    # ------------------------------------------------------------------ restarts
    def _restart(self, replica: int) -> None:
        """Start the replica again on the spawner thread (started and loaded there, off the event loop, its
        adapters added again); it serves once loaded."""
        old = self.replicas[replica]
        loop = asyncio.get_running_loop()
        loras = list(self._loras.values())

        def work() -> None:
            if old is not None:
                old.close(timeout=2.0)  # it is dead already: this frees its sockets
            client = None
            try:
                client = self._loading[replica] = self._factory(replica)
                if self._closing:
                    raise EngineDeadError("the engine is shut down")
                client.wait_ready()
                for lora in loras:
                    client.call_now("add_lora", [lora])
            except BaseException as e:
                if client is not None:
                    client.close()
                logger.error("data-parallel replica %d could not start again: %s", replica, e)
                _soon(loop, self._restart_failed, replica, f"restart failed: {e}")
                return
            finally:
                self._loading.pop(replica, None)
            _soon(loop, self._restarted, replica, client)

        logger.info("starting data-parallel replica %d again", replica)
        self._restarting.add(replica)
        self._spawner.submit(work)

    def _restarted(self, replica: int, client: MPClient) -> None:
        self._restarting.discard(replica)
        self._failed_restarts[replica] = 0
        if self._closing:
            client.close()
            return
        self.replicas[replica] = client
        self.restarts[replica] += 1
        self.lost.pop(replica, None)
        self.router.set_alive(replica, True)
        self._stats[replica] = client.ready.stats
        client.start(partial(self._on_message, replica), partial(self._on_replica_dead, replica))
        logger.info("data-parallel replica %d serves again (restart %d)", replica, self.restarts[replica])

    def _restart_failed(self, replica: int, why: str) -> None:
        self._restarting.discard(replica)
        self.lost[replica] = why
        self._failed_restarts[replica] += 1
        if self._failed_restarts[replica] < RESTART_ATTEMPTS and not self._closing:
            self._restarting.add(replica)  # still coming back: the front is not dead meanwhile
            asyncio.get_running_loop().call_later(RESTART_BACKOFF_S * self._failed_restarts[replica],
                                                  self._retry_restart, replica)
        self._check_any_left(why)

    def _retry_restart(self, replica: int) -> None:
        self._restarting.discard(replica)
        if not self._closing:
            self._restart(replica)

    def _check_any_left(self, why: str) -> None:
        """The front is dead once no replica runs and none is starting again."""
        if not any(self.router.alive) and not self._restarting and self._delivery is not None and not self._dead:
            self._dead = True
            self._delivery[1](EngineDeadError(f"every data-parallel replica stopped; the last: {why}"))

    # ------------------------------------------------------------------ calls
    def _fan_out(self, call: Call) -> None:
        if call.method == "add_lora" and call.args:
            self._loras[call.args[0].lora_int_id] = call.args[0]
        elif call.method == "remove_lora" and call.args:
            self._loras.pop(call.args[0], None)
        live = [i for i, r in enumerate(self.replicas) if r is not None and i not in self.lost]
        fan = _FanOut(call.call_id, call.method, set(live))
        for i in live:
            self._sub_ids += 1
            self._fanouts[(i, self._sub_ids)] = fan
            try:
                self._send_to(i, Call(call_id=self._sub_ids, method=call.method, args=call.args))
            except EngineDeadError:
                del self._fanouts[(i, self._sub_ids)]
                fan.waiting.discard(i)
        self._settle(fan)

    def _settle(self, fan: _FanOut) -> None:
        """Answer the front's call once every replica it went to answered or is gone."""
        if fan.waiting:
            return
        if fan.error is not None:
            self._deliver(Reply(call_id=fan.call_id, error=fan.error))
            return
        if not fan.results:
            self._deliver(Reply(call_id=fan.call_id, error=CoreError(type="EngineDeadError",
                                                                    message="no data-parallel replica answered")))
            return
        ordered = [fan.results[i] for i in sorted(fan.results)]
        if fan.method == "kv_state":
            result: Any = {"replicas": [{"index": i, **fan.results[i]} for i in sorted(fan.results)]}
        elif fan.method in ("rank_memory_usage", "collective_rpc"):  # every replica's ranks, in order
            result = [row for rows in ordered for row in rows]
        elif fan.method == "wake_up":  # fully awake: every replica
            result = all(ordered)
        elif fan.method in ("pause", "resume", "sleep", "release_kv_cache_memory"):
            result = None
        elif fan.method == "list_loras":
            result = sorted(set.intersection(*(set(r) for r in ordered)))
        elif fan.method == "get_stats":
            result = EngineStats.combine(ordered)
        else:  # add_lora, remove_lora: done on every replica; True if any replica changed
            result = any(ordered)
        self._deliver(Reply(call_id=fan.call_id, result=result))

    def stats(self) -> list[EngineStats]:
        """Each replica's statistics after its last step."""
        return list(self._stats)


def _soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)`` on the event loop, from another thread, unless the loop is gone (the front stopped)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nothing is left to tell
        pass
