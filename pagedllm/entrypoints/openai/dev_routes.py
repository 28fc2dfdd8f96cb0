"""vLLM's development routes, as vLLM 0.34 serves them with VLLM_SERVER_DEV_MODE=1 (here also
PAGEDLLM_SERVER_DEV_MODE=1): the RL frameworks' controls of the engine between rollouts. Without the variable
they do not exist (404), as in vLLM: /collective_rpc runs any method of the workers.

- ``POST /release_kv_cache_memory`` -> {"status": "kv_cache_released"}: sleep level 1 (the KV cache released,
  the weights kept), as vLLM's.
- ``POST /sleep?level=0|1|2&mode=abort|wait|keep`` -> {"status": "sleeping", "level"}; levels 1 and 2 need
  --enable-sleep-mode. ``POST /wake_up[?tags=weights&tags=kv_cache]`` -> {"status": "awake"|"sleeping",
  "tags"}; ``GET /is_sleeping`` -> {"is_sleeping"}. Requests that arrive asleep wait for the wake-up.
- ``POST /pause?mode=abort|wait|keep&clear_cache=true`` -> {"status": "paused"}; ``POST /resume``;
  ``GET /is_paused``. After "abort" and "wait" a new request is refused with 503 until /resume.
- ``POST /collective_rpc`` {"method", "args", "kwargs", "timeout"} -> {"results": one per worker} (None, lists
  and objects as they are, anything else as its text, as vLLM's route).

Query parameters are checked here: a bad one is a 400 naming it as vLLM does ("query.level").
"""
from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import JSONResponse

from pagedllm import envs
from pagedllm.engine.lifecycle import PAUSE_MODES
from pagedllm.entrypoints.openai.serving import RequestTimeoutError
from pagedllm.errors import ValidationError

logger = logging.getLogger("pagedllm.server")

router = APIRouter()
_TRUE, _FALSE = ("1", "true", "yes", "on", "t", "y"), ("0", "false", "no", "off", "f", "n")


def dev_mode() -> bool:
    """PAGEDLLM_SERVER_DEV_MODE or vLLM's VLLM_SERVER_DEV_MODE is on."""
    return envs.SERVER_DEV_MODE.read() or envs.VLLM_SERVER_DEV_MODE.read()


def attach_dev_routes(app: FastAPI) -> None:
    """Add the routes (build_app calls this in dev mode only)."""
    logger.warning("development routes are on (%s=1): /sleep, /pause, /collective_rpc ... let any client that "
                   "reaches this server pause it or run any worker method: never on an open network",
                   envs.VLLM_SERVER_DEV_MODE.name if envs.VLLM_SERVER_DEV_MODE.read() else envs.SERVER_DEV_MODE.name)
    app.include_router(router)


def _query(raw: Request, name: str, default: Any, parse: Any, expected: str) -> Any:
    """A query parameter parsed, its default when absent; a 400 naming "query.<name>" when it does not parse."""
    text = raw.query_params.get(name)
    if text is None:
        return default
    try:
        return parse(text)
    except ValueError:
        raise ValidationError.bad_value(f"query.{name}", text, expected) from None


def _level(text: str) -> int:
    if text.strip() not in ("0", "1", "2"):
        raise ValueError(text)
    return int(text)


def _mode(text: str) -> str:
    if text not in PAUSE_MODES:
        raise ValueError(text)
    return text


def _bool(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(text)


def _mode_of(raw: Request) -> str:
    return _query(raw, "mode", "abort", _mode, "'abort', 'wait' or 'keep'")


def _reset_connector(raw: Request) -> None:
    """vLLM's reset_connector (also reset a KV connector's cache): checked; there is no KV connector here."""
    _query(raw, "reset_connector", True, _bool, "true or false")


@router.post("/sleep")
async def sleep(raw: Request) -> JSONResponse:
    level = _query(raw, "level", 1, _level, "0, 1 or 2")
    mode = _mode_of(raw)
    _reset_connector(raw)
    await raw.app.state.engine.sleep(level, mode)
    raw.app.state.metrics.record_sleep_state(True, level)
    return JSONResponse({"status": "sleeping", "level": level})


@router.post("/release_kv_cache_memory")
async def release_kv_cache_memory(raw: Request) -> JSONResponse:
    """vLLM's: the KV cache's memory released, the weights kept (sleep level 1: what runs is aborted, new requests
    wait); ``POST /wake_up?tags=kv_cache`` brings it back."""
    _reset_connector(raw)
    await raw.app.state.engine.release_kv_cache_memory()
    raw.app.state.metrics.record_sleep_state(True, 1)
    return JSONResponse({"status": "kv_cache_released"})


@router.post("/wake_up")
async def wake_up(raw: Request) -> JSONResponse:
    tags = raw.query_params.getlist("tags") or None
    awake = await raw.app.state.engine.wake_up(tags)
    if awake:
        raw.app.state.metrics.record_sleep_state(False)
    return JSONResponse({"status": "awake" if awake else "sleeping", "tags": tags})


@router.get("/is_sleeping")
async def is_sleeping(raw: Request) -> JSONResponse:
    return JSONResponse({"is_sleeping": await raw.app.state.engine.is_sleeping()})


@router.post("/pause")
async def pause(raw: Request) -> JSONResponse:
    mode = _mode_of(raw)
    clear_cache = _query(raw, "clear_cache", True, _bool, "true or false")
    await raw.app.state.engine.pause_generation(mode, clear_cache)
    return JSONResponse({"status": "paused"})


@router.post("/resume")
async def resume(raw: Request) -> JSONResponse:
    await raw.app.state.engine.resume_generation()
    return JSONResponse({"status": "resumed"})


@router.get("/is_paused")
async def is_paused(raw: Request) -> JSONResponse:
    return JSONResponse({"is_paused": await raw.app.state.engine.is_paused()})


@router.post("/collective_rpc")
async def collective_rpc(raw: Request) -> JSONResponse:
    try:
        body = json.loads(await raw.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValidationError(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ValidationError("the request body must be a JSON object")
    unknown = sorted(set(body) - {"method", "args", "kwargs", "timeout"})
    if unknown:
        raise ValidationError(f"{unknown[0]} is not a field of /collective_rpc (method, args, kwargs, timeout)",
                              param=unknown[0])
    method = body.get("method")
    if not isinstance(method, str) or not method:
        raise ValidationError.bad_value("method", method, "the name of a worker method")
    args, kwargs, timeout = body.get("args", []), body.get("kwargs", {}), body.get("timeout")
    if not isinstance(args, list):
        raise ValidationError.bad_value("args", args, "a list")
    if not isinstance(kwargs, dict):
        raise ValidationError.bad_value("kwargs", kwargs, "an object")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValidationError.bad_value("timeout", timeout, "a positive number of seconds")
    try:
        results = await raw.app.state.engine.collective_rpc(method, timeout, args, kwargs)
    except TimeoutError:  # (asyncio's alias from 3.11)
        raise RequestTimeoutError(f"the workers did not answer {method!r} within {timeout:g} s (the call itself "
                                  "goes on)") from None
    return JSONResponse({"results": [r if r is None or isinstance(r, (dict, list)) else str(r) for r in results]})
