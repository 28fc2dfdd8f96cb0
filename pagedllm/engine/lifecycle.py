"""Pause, resume, sleep and wake-up of an engine core: vLLM 0.34's controls for RL frameworks (weight updates
between rollouts), on the core's own state.

- ``pause(mode)``: no new request starts. "abort" ends every request now (finish_reason "abort"); "wait" lets
  the running ones finish first; "keep" freezes them where they are (no step runs) until ``resume``. After
  "abort" and "wait" a new request is refused (EnginePausedError: HTTP 503, retry after resume); after "keep"
  it waits. ``clear_cache`` empties the prefix cache once drained ("keep" ignores it, as vLLM).
- ``release_kv_cache()``: sleep level 1 with only "kv_cache" asleep (vLLM's release_kv_cache_memory).
- ``sleep(level, mode)``: a pause whose new requests wait (as vLLM's), then level 1 releases the KV pool and
  the prefix cache, level 2 the weights too (worker/sleep.py); kept requests recompute after waking.
  ``wake_up(tags)`` brings back "weights" and/or "kv_cache" (all when None) and resumes once nothing sleeps.
- ``is_sleeping``: paused or asleep (vLLM's definition); ``is_paused``: paused.

A pause that waits for running requests completes between steps: the engine loop (engine/core_loop.py) holds
the caller's answer until ``try_finish`` says it is done, and holds the requests that arrive meanwhile. The
offline engine has no loop: there, "wait" with requests in flight and a request while paused are refused.
"""
from __future__ import annotations

from typing import Any, Protocol

from pagedllm.core.scheduler import Scheduler
from pagedllm.errors import ValidationError
from pagedllm.outputs import EngineCoreOutput
from pagedllm.worker.sleep import SLEEP_TAGS

PAUSE_MODES = ("abort", "wait", "keep")
"""How a pause treats the requests in flight (vLLM's PauseMode)."""
WAKE_TAGS = (*SLEEP_TAGS, "scheduling")
"""wake_up's tags: what to bring back; "scheduling" (vLLM's level-0 tag) only resumes."""


class EnginePausedError(RuntimeError):
    """A new request while generation is paused ("abort" or "wait" mode): retry after resume (HTTP 503)."""


class CollectiveRPCError(RuntimeError):
    """A user's worker method raised (that call fails alone: HTTP 500 naming the error)."""


def check_mode(mode: Any) -> str:
    if mode not in PAUSE_MODES:
        raise ValidationError.bad_value("mode", mode, "'abort', 'wait' or 'keep'")
    return mode


class _Core(Protocol):
    """What a Lifecycle uses of its engine core (engine/core.py's EngineCore; named here, not imported: the core
    imports this module)."""
    scheduler: Scheduler
    executor: Any
    loras: dict[int, Any]

    def abort_all(self) -> list[EngineCoreOutput]: ...


class Lifecycle:
    """One engine core's pause and sleep state; see the module docstring."""

    def __init__(self, core: _Core, enable_sleep_mode: bool) -> None:
        self.core = core
        self.enable_sleep_mode = enable_sleep_mode
        self.serving = False
        """Set by the engine loop: requests arriving paused are held there, and a pause may wait to drain."""
        self.paused = False
        self.reject = False
        """Paused by pause(mode "abort" or "wait"): new requests are refused, not held."""
        self.frozen = False
        """No step runs: paused with "keep", or asleep."""
        self.draining: tuple[bool, int] | None = None
        """A pause not completed yet: (clear the prefix cache, sleep level) to apply once nothing runs."""
        self.asleep: set[str] = set()
        """Tags released by sleep and not woken yet."""
        self.kv_only = False
        """The pending level-1 sleep is release_kv_cache's: only "kv_cache" falls asleep (the weights stay)."""
        self.level = 0

    # ------------------------------------------------------------------ state
    def admission(self) -> str:
        """What happens to a new request now: "admit", "reject" (EnginePausedError) or "hold" (until resume)."""
        if not self.paused:
            return "admit"
        return "reject" if self.reject else "hold"

    def check_admits(self) -> None:
        """Raise unless a new request may be queued now (the offline engine's check; the loop holds instead)."""
        verdict = self.admission()
        if verdict == "reject":
            raise EnginePausedError("generation is paused: retry after it resumes (POST /resume)")
        if verdict == "hold":
            what = "asleep: call wake_up()" if self.asleep or self.draining and self.draining[1] else \
                "paused: call resume()"
            raise ValidationError(f"the engine is {what} before adding requests")

    def is_sleeping(self) -> bool:
        return self.paused or bool(self.asleep)

    # ------------------------------------------------------------------ pause
    def pause(self, mode: str, clear_cache: bool, reject: bool | None, level: int = 0) -> list[EngineCoreOutput]:
        """Pause (see the module docstring); the outputs of the requests "abort" ended, for their callers.
        ``reject`` None leaves the refusal policy as it is (a sleep). Completes at ``try_finish``."""
        check_mode(mode)
        if not isinstance(clear_cache, bool):
            raise ValidationError.bad_value("clear_cache", clear_cache, "true or false")
        core = self.core
        if mode == "wait" and not self.serving and core.scheduler.has_unfinished_requests():
            raise ValidationError("mode 'wait' needs the engine loop (a server) to finish the requests in flight; "
                                  "use 'abort' or 'keep' here", param="mode", value=mode)
        outputs = core.abort_all() if mode == "abort" else []
        self.paused = True
        if reject is not None:
            self.reject = reject
        self.frozen = self.frozen or mode == "keep"
        clear = clear_cache and mode != "keep"
        if self.draining is not None:  # a pause already waiting: the deeper of the two
            clear, level = clear or self.draining[0], max(level, self.draining[1])
        self.draining = (clear, level)
        return outputs

    def drained(self) -> bool:
        """Nothing steps any more: the pending pause can complete."""
        return self.frozen or not self.core.scheduler.has_unfinished_requests()

    def try_finish(self) -> bool:
        """Complete a pending pause once drained (clear the cache, put the workers to sleep); whether none is
        pending now."""
        if self.draining is None:
            return True
        if not self.drained():
            return False
        clear, level = self.draining
        self.draining = None
        core = self.core
        if level >= 1:
            core.scheduler.drop_kv()  # nothing may point into the pool the workers release
            core.call_workers("sleep", (level,))
            self.asleep |= {"kv_cache"} if self.kv_only and level == 1 else set(SLEEP_TAGS)
            self.level = max(level, self.level)
            self.frozen = True
        elif clear:
            core.scheduler.kv_cache_manager.block_pool.reset_prefix_cache()
        return True

    def resume(self) -> None:
        """Scheduling goes on (idempotent); ValidationError while asleep."""
        if self.asleep:
            raise ValidationError(f"the engine is asleep ({', '.join(sorted(self.asleep))} released): wake it with "
                                  "wake_up (POST /wake_up) instead")
        self.paused = self.reject = self.frozen = False
        self.draining = None

    # ------------------------------------------------------------------ sleep
    def sleep(self, level: int, mode: str) -> list[EngineCoreOutput]:
        """Pause with ``mode``, then release memory by ``level`` (0: none); see the module docstring."""
        if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= 2:
            raise ValidationError.bad_value("level", level, "0, 1 or 2")
        if level and not self.enable_sleep_mode:
            raise ValidationError(f"sleep level {level} releases memory only in an engine started with "
                                  "enable_sleep_mode (--enable-sleep-mode); level 0 pauses scheduling",
                                  param="level", value=level)
        self.kv_only = False
        return self.pause(mode, clear_cache=level >= 1, reject=None, level=level)

    def release_kv_cache(self) -> list[EngineCoreOutput]:
        """vLLM's release_kv_cache_memory: sleep level 1 (what runs is aborted), the KV cache alone asleep; the
        weights were kept, so wake_up(["kv_cache"]) wakes the engine."""
        outputs = self.sleep(1, "abort")
        self.kv_only = self.draining is not None and self.draining[1] == 1
        return outputs

    def wake_up(self, tags: list[str] | None) -> bool:
        """Bring back ``tags`` (None: all) and resume once nothing sleeps; whether the engine is fully awake."""
        if tags is not None and (not isinstance(tags, (list, tuple)) or any(t not in WAKE_TAGS for t in tags)):
            raise ValidationError.bad_value("tags", tags, f"a list of {', '.join(map(repr, WAKE_TAGS))}")
        wanted = None if tags is None else set(tags) - {"scheduling"}
        wake = set(self.asleep) if wanted is None else wanted & self.asleep
        if wake:
            core = self.core
            core.call_workers("wake_up", (sorted(wake),))
            self.asleep -= wake
            if "weights" in wake and self.level == 2:  # the rebuilt workers learn the adapters again
                for lora in core.loras.values():
                    core.call_workers("add_lora", (lora,))
        if self.asleep:
            return False
        self.level = 0
        self.resume()
        return True

    # ------------------------------------------------------------------ collective_rpc
    def collective_rpc(self, method: str | bytes, args: Any = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """``method(*args, **kwargs)`` on every worker (a public worker or extension method, or a pickled
        function); each rank's result in rank order. A method that raises fails this call alone."""
        if not isinstance(args, (list, tuple)):
            raise ValidationError.bad_value("args", args, "a list")
        if kwargs is not None and (not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs)):
            raise ValidationError.bad_value("kwargs", kwargs, "an object (keyword -> value)")
        results = self.core.call_workers("user_rpc", (method, tuple(args), dict(kwargs or {})))
        for ok, value in results:
            if not ok:
                name, message, param = value
                if name == "ValidationError":
                    raise ValidationError(message, param=param)
                raise CollectiveRPCError(f"{name}: {message}")
        return [value for _, value in results]
