"""vLLM's deployment routes and flags: ``POST /invocations`` (SageMaker; ``/ping`` is beside /health in
api_server.py; its X-Amzn-SageMaker-Adapter-Identifier header picks the adapter; SageMaker's stateful sessions
with ``--enable-sagemaker-sessions``), SageMaker's adapter routes
``POST /adapters`` and ``DELETE /adapters/{name}`` (with run-time LoRA updating, as vLLM's
/v1/load_lora_adapter), ``--root-path``, ``--enable-request-id-headers``, ``GET /tokenizer_info``
(``--enable-tokenizer-info-endpoint``), ``GET /load`` (``--enable-server-load-tracking``) and
``POST /v1/chat/completions/batch`` (serving_chat_batch.py). build_app calls ``attach_deploy``."""
from __future__ import annotations

import argparse
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import pydantic
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette._utils import get_route_path
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm import envs
from pagedllm.entrypoints.openai.http_guard import UnicodeCheckedRoute
from pagedllm.entrypoints.openai.protocol import OpenAIModel
from pagedllm.errors import ValidationError, quoted

LOADED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/embeddings",
                "/v2/embed", "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank",
                "/invocations", "/generative_scoring", "/v1/decisions", "/v1/systemone",
                "/inference/v1/generate")
"""The routes /load counts while they run (vLLM's list, with its batch and SageMaker routes: prefixes)."""

PATH_FIELDS = ("name_or_path", "vocab_file", "merges_file", "tokenizer_file", "special_tokens_map_file")
"""Tokenizer settings /tokenizer_info leaves out: they name files on the server (any other key ending in
"_file" too)."""


@dataclass
class DeployOptions:
    """The deployment flags of ``pagedllm serve`` (vLLM's names)."""

    root_path: str | None = None
    """--root-path: the prefix a path-routing proxy serves the app under (FastAPI's root_path); routes answer
    with and without it."""
    enable_request_id_headers: bool = False
    """--enable-request-id-headers: every response carries X-Request-Id (the client's own, else a new one)."""
    enable_tokenizer_info_endpoint: bool = False
    """--enable-tokenizer-info-endpoint: serve GET /tokenizer_info (it shows the chat template)."""
    enable_server_load_tracking: bool = False
    """--enable-server-load-tracking: GET /load counts the inference requests in flight (else always 0)."""
    enable_sagemaker_sessions: bool = False
    """--enable-sagemaker-sessions (or SageMaker's SAGEMAKER_ENABLE_STATEFUL_SESSIONS): /invocations opens and
    closes SageMaker's stateful sessions (SageMakerSessions)."""


def add_deploy_args(parser: argparse.ArgumentParser) -> None:
    """The deployment flags, as vLLM spells them."""
    parser.add_argument("--root-path", default=None, metavar="PREFIX",
                        help="the path prefix a path-routing proxy serves this server under (FastAPI's root_path, "
                             "as vLLM): /PREFIX/v1/... and /v1/... both answer")
    parser.add_argument("--enable-request-id-headers", action="store_true",
                        help="add X-Request-Id to every response: the request's own X-Request-Id header, else a "
                             "new random id (as vLLM)")
    parser.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        help="serve GET /tokenizer_info: the tokenizer's settings and chat template (off: 404, as "
                             "vLLM)")
    parser.add_argument("--enable-server-load-tracking", action="store_true",
                        help="GET /load reports {\"server_load\": N}, the inference requests in flight (off: 0, as "
                             "vLLM)")
    parser.add_argument("--enable-sagemaker-sessions", action="store_true",
                        help="SageMaker's stateful sessions on /invocations: {\"requestType\": \"NEW_SESSION\"} "
                             "opens one (its id in X-Amzn-SageMaker-New-Session-Id), requests carry it in "
                             "X-Amzn-SageMaker-Session-Id, {\"requestType\": \"CLOSE\"} closes it (also "
                             f"{envs.SAGEMAKER_STATEFUL_SESSIONS.name}=true, as vLLM's SageMaker container)")


def deploy_options(ns: argparse.Namespace) -> DeployOptions:
    """The DeployOptions a parsed `pagedllm serve` command line holds."""
    root = ns.root_path
    if root is not None and root not in ("", "/"):
        if not root.startswith("/") or root.endswith("/") or len(root) > 1024:
            raise ValidationError(f"--root-path {quoted(root)} must start with '/' and not end with one",
                                  param="root_path", value=root)
    sessions = envs.SAGEMAKER_STATEFUL_SESSIONS.read()  # (read, and checked, even with the flag)
    return DeployOptions(root_path=None if root in (None, "", "/") else root,
                         enable_request_id_headers=ns.enable_request_id_headers,
                         enable_tokenizer_info_endpoint=ns.enable_tokenizer_info_endpoint,
                         enable_server_load_tracking=ns.enable_server_load_tracking,
                         enable_sagemaker_sessions=ns.enable_sagemaker_sessions or sessions)


class RequestIdMiddleware:
    """X-Request-Id on every HTTP response: the request's own header when it sent one, else a new uuid4 hex (as
    vLLM's; uvicorn's parser has already bounded the header)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(raw=message["headers"]).append("X-Request-Id", request_id)
            await send(message)

        await self.app(scope, receive, send_with_id)


class ServerLoadMiddleware:
    """Counts the inference requests in flight (LOADED_PATHS, from their start to the end of their response,
    streams included) in ``app.state.server_load``: what /load reports."""

    def __init__(self, app: ASGIApp, state: Any) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or \
                not get_route_path(scope).startswith(LOADED_PATHS):
            await self.app(scope, receive, send)
            return
        self.state.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.server_load -= 1


SESSION_HEADER = "X-Amzn-SageMaker-Session-Id"
"""A request's session (SageMaker routes the requests of one session to one instance)."""
NEW_SESSION_HEADER = "X-Amzn-SageMaker-New-Session-Id"
"""NEW_SESSION's answer: "<id>; Expires=<UTC time, ISO 8601>"."""
CLOSED_SESSION_HEADER = "X-Amzn-SageMaker-Closed-Session-Id"
"""CLOSE's answer: the id closed."""
SESSION_TTL_S = 20 * 60
"""A session's lifetime (SageMaker's default)."""
MAX_SESSIONS = 10_000
"""Sessions open at once (expired ones do not count): another NEW_SESSION is a 429 until one closes or expires."""
SESSION_REQUEST_TYPES = ("NEW_SESSION", "CLOSE")


class SageMakerSessions:
    """SageMaker's stateful sessions, as its hosting standard's session manager answers them: ids this server
    issued, each until it is closed or expires. A session holds nothing here (SageMaker's routing is what keeps a
    session's requests on one instance; the prefix cache keeps what they share)."""

    def __init__(self, ttl_s: float = SESSION_TTL_S, max_sessions: int = MAX_SESSIONS) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._expires: dict[str, float] = {}
        """Session id -> when it expires (time.time())."""

    def open(self) -> tuple[str, float]:
        """A new session: (its id, when it expires). 429 when MAX_SESSIONS are open."""
        now = time.time()
        for session_id in [s for s, t in self._expires.items() if t <= now]:
            del self._expires[session_id]
        if len(self._expires) >= self.max_sessions:
            raise HTTPException(429, f"{self.max_sessions} sessions are open: close one ({{\"requestType\": "
                                     "\"CLOSE\"}) or wait for one to expire")
        session_id = str(uuid.uuid4())
        self._expires[session_id] = now + self.ttl_s
        return session_id, self._expires[session_id]

    def check(self, session_id: str) -> None:
        """400 unless ``session_id`` is open (an expired one is forgotten)."""
        expires = self._expires.get(session_id)
        if expires is not None and expires <= time.time():
            del self._expires[session_id]
            expires = None
        if expires is None:
            raise ValidationError(f"session not found: {quoted(session_id)} (never opened here, closed, or expired)",
                                  param=SESSION_HEADER, value=session_id)

    def close(self, session_id: str) -> None:
        """Close an open session (400 if it is not)."""
        self.check(session_id)
        del self._expires[session_id]


def _session_request(body: dict, session_id: str | None, sessions: SageMakerSessions | None) -> Response | None:
    """SageMaker's session handling of an /invocations body: the answer to a NEW_SESSION or CLOSE request, None
    for an inference request (whose session header, if any, names an open session)."""
    if sessions is None:
        if session_id is not None or "requestType" in body:
            what = SESSION_HEADER if session_id is not None else "requestType"
            raise ValidationError(f"{what} (SageMaker's stateful sessions) needs --enable-sagemaker-sessions or "
                                  f"{envs.SAGEMAKER_STATEFUL_SESSIONS.name}=true", param=what)
        return None
    request_type = body.get("requestType")
    if "requestType" in body:
        extra = sorted(set(body) - {"requestType"})
        if extra:
            raise ValidationError(f"a session request holds requestType only; {quoted(extra)} not supported",
                                  param=str(extra[0]))
        if request_type not in SESSION_REQUEST_TYPES:
            raise ValidationError.bad_value("requestType", request_type, f"one of {list(SESSION_REQUEST_TYPES)}")
    if session_id is not None:
        sessions.check(session_id)
    if request_type == "NEW_SESSION":
        new_id, expires = sessions.open()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expires))
        return PlainTextResponse(f"Session {new_id} created",
                                 headers={NEW_SESSION_HEADER: f"{new_id}; Expires={stamp}"})
    if request_type == "CLOSE":
        if session_id is None:  # (SageMaker's own answer to it: 424)
            raise HTTPException(424, f"invalid session_id: a CLOSE request names its session in {SESSION_HEADER}")
        sessions.close(session_id)
        return PlainTextResponse(f"Session {session_id} closed", headers={CLOSED_SESSION_HEADER: session_id})
    return None


router = APIRouter(route_class=UnicodeCheckedRoute)
"""Routes every server has: /invocations, /load, /v1/chat/completions/batch."""

tokenizer_info_router = APIRouter(route_class=UnicodeCheckedRoute)
"""/tokenizer_info: only with --enable-tokenizer-info-endpoint."""

sagemaker_lora_router = APIRouter(route_class=UnicodeCheckedRoute)
"""SageMaker's /adapters routes: build_app includes them with the /v1/load_lora_adapter ones (run-time LoRA
updating on), as vLLM does."""

ADAPTER_HEADER = "X-Amzn-SageMaker-Adapter-Identifier"
"""/invocations: the adapter (or served model) to run, in place of the body's model (SageMaker's inference
components send it)."""


class SageMakerLoadAdapterRequest(OpenAIModel):
    """SageMaker's POST /adapters body: the adapter's name and its folder (src)."""

    name: str
    src: str
    load_inplace: pydantic.StrictBool = False
    """As /v1/load_lora_adapter's: an adapter already loaded under name is replaced."""
    preload: Literal[True] = True
    """SageMaker's flag: the adapter is read now (always, here: reading it later is not supported)."""


@router.get("/load")
async def server_load(request: Request) -> dict:
    """vLLM's {"server_load": N}: the inference requests in flight (0 without --enable-server-load-tracking)."""
    return {"server_load": request.app.state.server_load}


@tokenizer_info_router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict:
    """The tokenizer's own settings (its init_kwargs, tokens as their text; no file names or paths), its class
    and the chat template the server renders with, as vLLM's /tokenizer_info."""
    state = request.app.state
    tokenizer = state.engine.tokenizer
    info = {key: _json_value(value) for key, value in dict(getattr(tokenizer, "init_kwargs", None) or {}).items()
            if key not in PATH_FIELDS and not key.endswith("_file")}
    info["tokenizer_class"] = type(tokenizer).__name__
    template = state.chat.chat_template or getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template:
        info["chat_template"] = template
    return info


def _json_value(value: Any) -> Any:
    """A tokenizer setting as JSON: an AddedToken as its text, containers walked, anything else (a non-finite
    float too) as its string."""
    if hasattr(value, "content") and isinstance(value.content, str):
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value)):
        return value
    return str(value)  # (a NaN or infinity too: JSON has none)


@sagemaker_lora_router.post("/adapters")
async def load_adapter(req: SageMakerLoadAdapterRequest, raw: Request) -> Response:
    """SageMaker's adapter load: /v1/load_lora_adapter with lora_name = name, lora_path = src (its errors too:
    400 for a name taken or an adapter refused, 404 for a folder without one)."""
    await raw.app.state.models.load(req.name, req.src, req.load_inplace)
    return PlainTextResponse(f"Adapter {req.name} registered")


@sagemaker_lora_router.delete("/adapters/{adapter_name}")
async def unload_adapter(adapter_name: str, raw: Request) -> Response:
    """SageMaker's adapter unload: /v1/unload_lora_adapter of the adapter the path names (404 if there is none,
    400 for an operator's --lora-modules adapter)."""
    await raw.app.state.models.unload(adapter_name)
    return PlainTextResponse(f"Adapter {adapter_name} unregistered")


Endpoint = Callable[[Any, Request], Awaitable[Response]]
"""A route's function as api_server.py defines it: (its parsed request, the raw request) -> the response."""


def invocation_types(request: Request) -> list[tuple[type[pydantic.BaseModel], Endpoint, tuple[str, ...]]]:
    """What /invocations may route to on this server, in vLLM's order: (request type, its route's function, the
    body keys that mark that type). A generating model: chat, then completions; a pooling model: embeddings,
    classification, rerank, score (by its tasks), then /pooling."""
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from pagedllm.entrypoints.openai.protocol_pooling import (
        ClassificationRequest,
        EmbeddingRequest,
        PoolingRequest,
        RerankRequest,
        ScoreRequest,
    )

    api = request.app.state.endpoints  # (api_server.py's route functions, set by build_app: no import back up)
    model = request.app.state.config.model
    if model.runner != "pooling":
        return [(ChatCompletionRequest, api.chat_completions, ("messages",)),
                (CompletionRequest, api.completions, ("prompt",))]
    tasks = model.pooling_tasks or ()
    types: list[tuple[type[pydantic.BaseModel], Endpoint, tuple[str, ...]]] = []
    if "embed" in tasks:
        types.append((EmbeddingRequest, api.embeddings, ("input", "messages")))
    if "classify" in tasks:
        types.append((ClassificationRequest, api.classify, ("input",)))
    if "score" in tasks:
        types += [(RerankRequest, api.rerank, ("query", "documents")),
                  (ScoreRequest, api.score, ("text_1", "text_2", "queries", "documents"))]
    return types + [(PoolingRequest, api.pooling, ("input", "messages"))]


ANSWERING_ROUTE = "pagedllm.answering_route"
"""The scope key /invocations sets to the path of the route that answers a request (its errors are that route's)."""


@router.post("/invocations")
async def invocations(raw: Request) -> Response:
    """SageMaker's inference route, as vLLM's: the body goes to the first of this server's request types it
    validates as (chat before completions; embeddings, classification, rerank, score, pooling on a pooling
    model), answered exactly as that route answers. A body none takes is a 400: the field error of the first
    type whose keys it has, else vLLM's "Cannot find suitable handler" naming the types."""
    try:
        body = await raw.json()
    except ValueError as e:
        raise ValidationError(f"request body is not valid JSON: {quoted(str(e))}") from None
    if not isinstance(body, dict):
        raise ValidationError("the request body must be a JSON object", param="body")
    session = _session_request(body, raw.headers.get(SESSION_HEADER), raw.app.state.sagemaker_sessions)
    if session is not None:
        return session
    adapter = raw.headers.get(ADAPTER_HEADER)
    if adapter is not None:
        body["model"] = adapter  # (an unknown name: the route's 404, as a body naming it)
    types = invocation_types(raw)
    first_error: pydantic.ValidationError | None = None
    for request_type, endpoint, keys in types:
        try:
            req = request_type.model_validate(body)
        except pydantic.ValidationError as e:
            if first_error is None and any(key in body for key in keys):
                first_error = e
            continue
        # its errors are that route's too (vLLM's pooling routes name their own error types: api_server.py)
        raw.scope[ANSWERING_ROUTE] = raw.app.state.endpoint_paths.get(endpoint)
        return await endpoint(req, raw)
    if first_error is not None:
        raise RequestValidationError(first_error.errors(include_url=False))  # (its context: a model's own check)
    names = [request_type.__name__ for request_type, _, _ in types]
    raise ValidationError(f"Cannot find suitable handler for request. Expected one of: {names}", param="body")


def attach_deploy(app: FastAPI, options: DeployOptions | None) -> None:
    """The deployment routes and middleware on ``app``; called after the API-key middleware is added, so that
    these wrap it: a refused request still carries its X-Request-Id."""
    from pagedllm.entrypoints.openai.serving_chat_batch import router as batch_router

    options = options or DeployOptions()
    app.state.server_load = 0
    app.state.sagemaker_sessions = SageMakerSessions() if options.enable_sagemaker_sessions else None
    app.include_router(router)
    app.include_router(batch_router)
    if options.enable_tokenizer_info_endpoint:
        app.include_router(tokenizer_info_router)
    if options.root_path:
        app.root_path = options.root_path  # (the attribute: FastAPI's constructor argument is deprecated)
    if options.enable_server_load_tracking:
        app.add_middleware(ServerLoadMiddleware, state=app.state)
    if options.enable_request_id_headers:
        app.add_middleware(RequestIdMiddleware)

