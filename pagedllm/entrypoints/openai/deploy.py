"""vLLM's deployment routes and flags: ``POST /invocations`` (SageMaker; ``/ping`` is beside /health in
api_server.py), ``--root-path``, ``--enable-request-id-headers``, ``GET /tokenizer_info``
(``--enable-tokenizer-info-endpoint``), ``GET /load`` (``--enable-server-load-tracking``) and
``POST /v1/chat/completions/batch`` (serving_chat_batch.py). build_app calls ``attach_deploy``."""
from __future__ import annotations

import argparse
import math
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pydantic
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette._utils import get_route_path
from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.entrypoints.openai.http_guard import UnicodeCheckedRoute
from pagedllm.errors import ValidationError, quoted

LOADED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/embeddings",
                "/v2/embed", "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank",
                "/invocations")
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


def deploy_options(ns: argparse.Namespace) -> DeployOptions:
    """The DeployOptions a parsed `pagedllm serve` command line holds."""
    root = ns.root_path
    if root is not None and root not in ("", "/"):
        if not root.startswith("/") or root.endswith("/") or len(root) > 1024:
            raise ValidationError(f"--root-path {quoted(root)} must start with '/' and not end with one",
                                  param="root_path", value=root)
    return DeployOptions(root_path=None if root in (None, "", "/") else root,
                         enable_request_id_headers=ns.enable_request_id_headers,
                         enable_tokenizer_info_endpoint=ns.enable_tokenizer_info_endpoint,
                         enable_server_load_tracking=ns.enable_server_load_tracking)


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


router = APIRouter(route_class=UnicodeCheckedRoute)
"""Routes every server has: /invocations, /load, /v1/chat/completions/batch."""

tokenizer_info_router = APIRouter(route_class=UnicodeCheckedRoute)
"""/tokenizer_info: only with --enable-tokenizer-info-endpoint."""


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


Endpoint = Callable[[Any, Request], Awaitable[Response]]
"""A route's function as api_server.py defines it: (its parsed request, the raw request) -> the response."""


def invocation_types(request: Request) -> list[tuple[type[pydantic.BaseModel], Endpoint, tuple[str, ...]]]:
    """What /invocations may route to on this server, in vLLM's order: (request type, its route's function, the
    body keys that mark that type). A generating model: chat, then completions; a pooling model: embeddings,
    classification, rerank, score (by its tasks), then /pooling."""
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from pagedllm.entrypoints.openai.protocol_pooling import (ClassificationRequest, EmbeddingRequest,
                                                              PoolingRequest, RerankRequest, ScoreRequest)

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
    types = invocation_types(raw)
    first_error: pydantic.ValidationError | None = None
    for request_type, endpoint, keys in types:
        try:
            req = request_type.model_validate(body)
        except pydantic.ValidationError as e:
            if first_error is None and any(key in body for key in keys):
                first_error = e
            continue
        return await endpoint(req, raw)
    if first_error is not None:
        raise RequestValidationError(first_error.errors(include_url=False, include_context=False))
    names = [request_type.__name__ for request_type, _, _ in types]
    raise ValidationError(f"Cannot find suitable handler for request. Expected one of: {names}", param="body")


def attach_deploy(app: FastAPI, options: DeployOptions | None) -> None:
    """The deployment routes and middleware on ``app``; called after the API-key middleware is added, so that
    these wrap it: a refused request still carries its X-Request-Id."""
    from pagedllm.entrypoints.openai.serving_chat_batch import router as batch_router

    options = options or DeployOptions()
    app.state.server_load = 0
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

