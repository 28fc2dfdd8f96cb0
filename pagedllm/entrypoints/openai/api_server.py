"""The OpenAI-compatible server: FastAPI app, error bodies, API keys, metrics, graceful shutdown."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hmac
import logging
import os
import signal
import stat
import threading
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from starlette._utils import get_route_path
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

import pagedllm
from pagedllm import envs
from pagedllm.config import DEFAULT_MODEL_NAME
from pagedllm.engine import local_core
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.engine.lifecycle import CollectiveRPCError, EnginePausedError
from pagedllm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest, anthropic_error
from pagedllm.entrypoints.anthropic.serving_messages import AnthropicServingMessages
from pagedllm.entrypoints.openai.chat_options import template_options
from pagedllm.entrypoints.openai.deploy import (
    ANSWERING_ROUTE,
    DeployOptions,
    RequestIdMiddleware,
    add_deploy_args,
    attach_deploy,
    deploy_options,
    sagemaker_lora_router,
    tokenizer_info_router,
)
from pagedllm.entrypoints.openai.derender_stream import (
    STREAMED,
    WHOLE,
    ChatDerenderBody,
    CompletionDerenderBody,
    DerenderChatStreamRequest,
    DerenderCompletionStreamRequest,
    derender_chat_stream,
    derender_completion_stream,
)
from pagedllm.entrypoints.openai.dev_routes import attach_dev_routes, dev_mode
from pagedllm.entrypoints.openai.http_guard import (
    ANTHROPIC_PATHS,
    COHERE_PATHS,
    GuardedServer,
    UnicodeCheckedRoute,
    add_http_args,
    serve_config,
)
from pagedllm.entrypoints.openai.http_guard import positive as _positive
from pagedllm.entrypoints.openai.limits import (
    BYTES_PER_TOKEN_CAP,
    ServingLimits,
    add_limit_args,
    check_tools,
    serving_limits,
)
from pagedllm.entrypoints.openai.metrics import ORCA_FORMATS, ServerMetrics, orca_header
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from pagedllm.entrypoints.openai.protocol_cohere import CohereEmbedRequest
from pagedllm.entrypoints.openai.protocol_decisions import DecisionRequest, StructuredDecisionRequest
from pagedllm.entrypoints.openai.protocol_pooling import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from pagedllm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagedllm.entrypoints.openai.reasoning import PARSERS as REASONING_PARSERS
from pagedllm.entrypoints.openai.reasoning import ReasoningConfig, get_reasoning_parser, parse_reasoning_config
from pagedllm.entrypoints.openai.serving import Admission, OverloadedError, RequestFailedError, RequestTimeoutError
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_cohere import CohereServingEmbed
from pagedllm.entrypoints.openai.serving_cohere_chat import CohereChatOptions, CohereChatRequest, CohereServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_decisions import DecisionsUnsupportedError, OpenAIServingDecisions
from pagedllm.entrypoints.openai.serving_derender import derender_chat, derender_completion
from pagedllm.entrypoints.openai.serving_generative_scoring import (
    GenerativeScoringRequest,
    OpenAIServingGenerativeScoring,
)
from pagedllm.entrypoints.openai.serving_models import (
    RUNTIME_LORA_ENV,
    LoRAModulePath,
    ModelNotFoundError,
    OpenAIServingModels,
    parse_lora_module,
    public_name,
    runtime_lora_updating,
)
from pagedllm.entrypoints.openai.serving_pooling import OpenAIServingPooling, check_generates
from pagedllm.entrypoints.openai.serving_render import render_chat, render_completion
from pagedllm.entrypoints.openai.serving_responses import (
    KEY_INDEX,
    OpenAIServingResponses,
    ResponseNotFoundError,
    ResponseStore,
)
from pagedllm.entrypoints.openai.serving_tokens import ServingTokens, attach_tokens
from pagedllm.entrypoints.openai.tool_calls import TOOL_PARSERS, get_tool_parser
from pagedllm.errors import ValidationError

logger = logging.getLogger("pagedllm.server")
DEAD_EXIT_DELAY_S = 2.0
"""Seconds a server whose engine died keeps answering (503 on /health, errors on requests) before
it exits with status 1: health checkers see why."""

KV_PAGE = Path(__file__).parent / "static" / "kv.html"
"""The /kv page: plain HTML and JavaScript, no build step."""

_SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals that start a graceful shutdown."""


POOLING_PATHS = ("/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank",
                 "/v2/rerank", "/generative_scoring", "/v1/decisions", "/v1/systemone")
"""vLLM's pooling routes (and its generative scoring and structured decision routes): their 400s and 404s say
vLLM's error types (POOLING_ERROR_TYPES), which vLLM's clients of them check, in place of OpenAI's
invalid_request_error."""
POOLING_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError"}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   type_: str = "invalid_request_error", path: str = "") -> JSONResponse:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}; on the Anthropic Messages API's
    ``path``, Anthropic's: {"type": "error", "error": {"type", "message"}}; on vLLM's pooling routes a client
    error's type is vLLM's (POOLING_PATHS). The message and param are cut to MAX_ERROR_CHARS (a backstop: call sites
    quote client values with errors.quoted)."""
    message, param = _cut(message, MAX_ERROR_CHARS), None if param is None else _cut(param, MAX_ERROR_CHARS // 8)
    if path.startswith(ANTHROPIC_PATHS):
        return JSONResponse(anthropic_error(status, message), status_code=status)
    if path.startswith(COHERE_PATHS):  # Cohere's {"message", "id"}: the message names the field (param is ours)
        return JSONResponse({"message": message}, status_code=status)
    if type_ == "invalid_request_error" and path.startswith(POOLING_PATHS):
        type_ = POOLING_ERROR_TYPES.get(status, type_)
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


MAX_ERROR_CHARS = 2048
"""Most characters of an error message (a param: an eighth of it): no error echoes a client's megabyte back."""


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _error(request: Request, status: int, message: str, param: str | None = None, code: str | None = None,
           type_: str = "invalid_request_error") -> JSONResponse:
    """The error body for ``request``'s API (see error_response)."""
    path = request.scope.get(ANSWERING_ROUTE) or get_route_path(request.scope)  # (no --root-path)
    return error_response(status, message, param, code, type_, path)


PROTECTED = ("/v1", "/kv/state", "/tokenize", "/detokenize", "/pooling", "/classify", "/score", "/rerank", "/v2",
             "/cohere",
             "/generative_scoring", "/inference",
             "/invocations", "/tokenizer_info", "/adapters")
"""Paths an API key guards (the KV map's data names the requests it shows; the page itself holds no data and
sends the key given in its address's fragment: /kv#key=KEY; /tokenize and /detokenize run the tokenizer; vLLM's
pooling endpoints and SageMaker's /invocations run the model (vLLM leaves /invocations open); /tokenizer_info shows
the chat template; SageMaker's /adapters loads adapters as /v1/load_lora_adapter does; /inference is vLLM's
token-in/token-out API, whose legacy /abort_requests stays open as in vLLM). Matched on the path under
--root-path: /PREFIX/v1/... is guarded as /v1/... is."""


class APIKeyMiddleware:
    """401 on PROTECTED paths without a valid ``Authorization: Bearer <key>`` or ``x-api-key: <key>`` (the
    Anthropic SDK's header), compared in constant time; the index of the key that matched is recorded in the
    request's state (KEY_INDEX): stored responses belong to it."""

    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            index = self._key_index(scope)
            if index is None and get_route_path(scope).startswith(PROTECTED):
                response = error_response(401, "invalid or missing API key", code="invalid_api_key",
                                          path=get_route_path(scope))
                await response(scope, receive, send)
                return
            # a new dict: the server's per-request state must not be shared between requests
            scope["state"] = {**scope.get("state", {}), KEY_INDEX: index}
        await self.app(scope, receive, send)

    def _key_index(self, scope: Scope) -> int | None:
        """The index of the key the request presents (None: none valid)."""
        headers = dict(scope["headers"])
        header = headers.get(b"authorization", b"")
        tokens = [header[7:] if header[:7].lower() == b"bearer " else b"", headers.get(b"x-api-key", b"")]
        # compare every token with every key: no early exit
        matches = [hmac.compare_digest(token, key) for token in tokens for key in self.keys]
        index = next((i for i, match in enumerate(matches) if match), None)
        return None if index is None else index % len(self.keys)


def _field_name(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body" and p not in (WHOLE, STREAMED)]  # (derender's form tags)
    if not parts or parts[0].isdigit():  # a JSON syntax error reports a character position
        return None
    name = parts[0]
    for p in parts[1:]:
        if p.isdigit():
            name += f"[{p}]"
        elif p in ("str", "list[int]", "list[str]", "list[list[int]]", "list[ContentPart]", "int", "float"):
            break  # pydantic names the union member it tried; the field is what the user sees
        else:
            name += f".{p}"
    return name


router = APIRouter(route_class=UnicodeCheckedRoute)  # a lone surrogate in a JSON body: 400 naming the field
"""The server's routes; each reaches the engine and the serving objects build_app made through
``request.app.state``."""

lora_router = APIRouter(route_class=UnicodeCheckedRoute)
"""vLLM's run-time adapter routes: build_app includes them only with --allow-runtime-lora-updating (off: the routes
do not exist, 404, as in vLLM); any client that reaches them may make the server read any folder it can."""


def _engine(request: Request) -> Any:
    """The engine build_app was given (its type: build_app's signature)."""
    return request.app.state.engine


def _models(request: Request) -> OpenAIServingModels:
    return request.app.state.models


def _completion(request: Request) -> OpenAIServingCompletion:
    return request.app.state.completion


def _chat(request: Request) -> OpenAIServingChat:
    return request.app.state.chat


def _pooling(request: Request) -> OpenAIServingPooling:
    return request.app.state.pooling


def _generates(request: Request) -> None:
    """A generation endpoint on a pooling model: 400 naming the endpoints to use instead."""
    check_generates(request.app.state.config.model, request.url.path)


@router.get("/health")
@router.get("/ping")
@router.post("/ping")
async def health(request: Request) -> Response:
    """200 while the engine serves (empty, as vLLM's); with data parallelism a JSON body names each replica's
    state, and "degraded" while some are stopped (the others serve). 503 once nothing serves."""
    engine = _engine(request)
    replicas = engine.replica_states(details=False) if engine.is_running else None  # no pids or addresses
    if replicas is not None:
        degraded = any(r["status"] != "running" for r in replicas)
        return JSONResponse({"status": "degraded" if degraded else "ok", "replicas": replicas})
    if engine.is_running:
        return Response(status_code=200)
    return error_response(503, "the engine loop is not running", type_="server_error")


@router.get("/version")
async def version() -> dict:
    return {"version": pagedllm.__version__}


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    metrics: ServerMetrics = request.app.state.metrics
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/stats")
async def stats(request: Request) -> dict:
    """Engine statistics (steps, preemptions, max running, KV usage): pagedllm's own extra."""
    return vars(_engine(request).get_stats())


@router.get("/kv", include_in_schema=False)
async def kv_page() -> Response:
    """The live KV-cache map (an HTML page drawing /kv/state once a second)."""
    return HTMLResponse(KV_PAGE.read_text(encoding="utf-8"))


@router.get("/kv/state")
async def kv_state(request: Request) -> dict:
    """The KV pool between two steps: each block's holder, fill and sharing, the slots' accounting, and
    its history (about a sample a second, the last ten minutes): pagedllm's own extra."""
    return {"time": time.time(), **(await _engine(request).kv_state())}


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    return ModelList(data=_models(request).cards()).model_dump()


@lora_router.post("/v1/load_lora_adapter")
async def load_lora_adapter(req: LoadLoRAAdapterRequest, raw: Request) -> Response:
    """The adapter is served under lora_name from then on (400 if the name is taken, unless load_inplace replaces
    the adapter of that name, or if it does not fit; 404 if lora_path holds no adapter)."""
    await _models(raw).load(req.lora_name, req.lora_path, req.load_inplace)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@lora_router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(req: UnloadLoRAAdapterRequest, raw: Request) -> Response:
    """Remove a run-time adapter (400 for a --lora-modules one, 404 if unknown)."""
    await _models(raw).unload(req.lora_name, req.lora_int_id)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


LOAD_FORMAT_HEADER = "endpoint-load-metrics-format"
"""A request header asking for ORCA's load report (TEXT or JSON) in the reply's ``endpoint-load-metrics``."""
_unknown_load_formats: set[str] = set()
"""Formats already warned about (a few: each is logged once)."""


def _with_load_report(raw: Request, response: Response) -> Response:
    """vLLM's ORCA load report: a chat or completions request with an ``endpoint-load-metrics-format`` header
    gets the engine's load as of its last step (KV cache usage, requests waiting: ServerMetrics.load_figures) in
    an ``endpoint-load-metrics`` header, streamed replies too (the load as the stream starts; vLLM reports on whole
    replies only). Another format gets none, as in vLLM, and a warning in the log."""
    metrics_format = raw.headers.get(LOAD_FORMAT_HEADER)
    if not metrics_format or response.status_code != 200:
        return response
    metrics: ServerMetrics = raw.app.state.metrics
    header = orca_header(metrics_format, metrics.load_figures())
    if header is not None:
        response.headers["endpoint-load-metrics"] = header
    elif len(_unknown_load_formats) < 16 and metrics_format not in _unknown_load_formats:
        _unknown_load_formats.add(metrics_format)
        logger.warning("%s %r: no load report (the formats are %s)", LOAD_FORMAT_HEADER, metrics_format[:64],
                       " and ".join(f.upper() for f in ORCA_FORMATS))
    return response


@router.post("/v1/completions")
async def completions(req: CompletionRequest, raw: Request) -> Response:
    _generates(raw)
    return _with_load_report(raw, await _completion(raw).create(req, raw))


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
    _generates(raw)
    return _with_load_report(raw, await _chat(raw).create(req, raw))


@router.post("/v1/responses")
async def create_response(req: ResponsesRequest, raw: Request) -> Response:
    _generates(raw)
    return await raw.app.state.responses.create(req, raw)


@router.get("/v1/responses/{response_id}", response_model=None)
async def get_response(response_id: str, request: Request, stream: bool = False,
                       starting_after: int | None = None) -> dict | Response:
    return request.app.state.responses.get(response_id, request, stream, starting_after)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict:
    return await request.app.state.responses.delete(response_id, request)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> dict:
    return await request.app.state.responses.cancel(response_id, request)


@router.post("/v1/messages")
async def create_message(req: MessagesRequest, raw: Request) -> Response:
    _generates(raw)
    return await raw.app.state.messages.create(req, raw)


@router.post("/v1/messages/count_tokens")
async def count_tokens(req: CountTokensRequest, raw: Request) -> dict:
    return await raw.app.state.messages.count_tokens(req)


@router.post("/v1/embeddings")
async def embeddings(req: EmbeddingRequest, raw: Request) -> Response:
    return await _pooling(raw).embed(req, raw)


@router.post("/pooling")
async def pooling(req: PoolingRequest, raw: Request) -> Response:
    return await _pooling(raw).pool(req, raw)


@router.post("/classify")
async def classify(req: ClassificationRequest, raw: Request) -> Response:
    return await _pooling(raw).classify(req, raw)


@router.post("/score")
@router.post("/v1/score")
async def score(req: ScoreRequest, raw: Request) -> Response:
    return await _pooling(raw).score(req, raw)


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(req: RerankRequest, raw: Request) -> Response:
    return await _pooling(raw).rerank(req, raw)


@router.post("/generative_scoring")
async def generative_scoring(req: GenerativeScoringRequest, raw: Request) -> Response:
    """vLLM's Generative Scoring API: each item's probability of the first label token after query + item."""
    _generates(raw)
    return await raw.app.state.generative_scoring.score(req, raw)


@router.post("/v1/decisions")
async def create_decisions(req: DecisionRequest, raw: Request) -> Response:
    """vLLM's Decisions API: each question answered from the model's next-token label probabilities."""
    _generates(raw)
    try:
        return await raw.app.state.decisions.decide(req, raw)
    except DecisionsUnsupportedError as e:
        return _error(raw, 501, str(e), type_="NotImplementedError")


@router.post("/v1/systemone")
async def create_structured_decision(req: StructuredDecisionRequest, raw: Request) -> Response:
    """vLLM's structured decisions API (questions by id; choice, noul and score types)."""
    _generates(raw)
    try:
        return await raw.app.state.decisions.systemone(req, raw)
    except DecisionsUnsupportedError as e:
        return _error(raw, 501, str(e), type_="NotImplementedError")


@router.post("/v2/embed")
async def cohere_embed(req: CohereEmbedRequest, raw: Request) -> Response:
    """Cohere's embed API (vLLM's /v2/embed)."""
    return await raw.app.state.cohere_embed.embed(req, raw)


@router.post("/cohere/v2/chat")
async def cohere_chat(req: CohereChatRequest, raw: Request) -> Response:
    """Cohere's Chat v2 API (vLLM's /cohere/v2/chat), mapped onto chat completions."""
    _generates(raw)
    return await raw.app.state.cohere_chat.create(req, raw)


render_router = APIRouter(route_class=UnicodeCheckedRoute)
"""vLLM's scale-out render routes, served with --enable-scale-out or --tokens-only (as vLLM's): a request checked
and rendered, not run, as the /inference/v1/generate request(s) that run it (serving_render.py)."""


@render_router.post("/cohere/v2/chat/render")
async def cohere_chat_render(req: CohereChatRequest, raw: Request) -> dict:
    """A Cohere v2 chat request rendered, not run: its prompt's token ids and sampling params."""
    _generates(raw)
    return await raw.app.state.cohere_chat.render(req, raw)


@render_router.post("/v1/chat/completions/render")
async def chat_render(req: ChatCompletionRequest, raw: Request) -> dict:
    """A chat completion request rendered, not run (vLLM's GenerateRequest)."""
    _generates(raw)
    return await render_chat(_chat(raw), req, raw)


@render_router.post("/v1/chat/completions/derender")
async def chat_derender(req: ChatDerenderBody, raw: Request) -> dict:
    """A generate reply's tokens as the chat completion the coupled route would answer (serving_derender.py); with
    stream: true, one generate chunk's as the chunk it would stream, and the state for the next (derender_stream.py)."""
    if isinstance(req, DerenderChatStreamRequest):
        return await derender_chat_stream(_chat(raw), req)
    return await derender_chat(_chat(raw), req)


@render_router.post("/v1/completions/derender")
async def completion_derender(req: CompletionDerenderBody, raw: Request) -> dict:
    """Generate replies' tokens (one per prompt) as the completions reply the coupled route would answer; with
    stream: true, one generate chunk's as the chunk it would stream, and the state for the next."""
    if isinstance(req, DerenderCompletionStreamRequest):
        return await derender_completion_stream(_completion(raw), req)
    return await derender_completion(_completion(raw), req)


@render_router.post("/v1/messages/render")
async def messages_render(req: MessagesRequest, raw: Request) -> dict:
    """An Anthropic Messages request rendered, not run: the generate request of the chat request it maps onto."""
    _generates(raw)
    return await raw.app.state.messages.render(req)


@render_router.post("/v1/responses/render")
async def responses_render(req: ResponsesRequest, raw: Request) -> dict:
    """A Responses request rendered, not run: the generate request of the chat request it maps onto."""
    _generates(raw)
    return await raw.app.state.responses.render(req)


@render_router.post("/v1/completions/render")
async def completion_render(req: CompletionRequest, raw: Request) -> list[dict]:
    """A completion request rendered, not run: one generate request per prompt."""
    _generates(raw)
    return await render_completion(_completion(raw), req, raw)


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, raw: Request) -> dict:
    completion, chat = _completion(raw), _chat(raw)
    completion.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise ValidationError("give exactly one of prompt and messages", param="prompt")
    completion.check_prompt_size(req.prompt, "prompt")  # the --max-prompt-bytes cap, before tokenizing
    chat.check_prompt_size(req.messages, "messages")
    if req.tools is not None and req.messages is None:
        raise ValidationError("tools are shown by the chat template: give them with messages", param="tools")
    check_tools(req.tools, chat.limits)
    if req.messages is not None:  # (chat's template options: continue_final_message, chat_template(_kwargs))
        _, ids = await chat.render(req.messages, req.add_generation_prompt, req.tools,
                                   template_options(req, chat.trust_request_chat_template))
    else:
        ids = await _engine(raw).in_tokenizer_thread(
            lambda: completion.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
    max_model_len = raw.app.state.config.model.max_model_len
    strs = completion.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs).model_dump()


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, raw: Request) -> dict:
    completion = _completion(raw)
    completion.check_model(req.model)
    max_model_len = raw.app.state.config.model.max_model_len
    if len(req.tokens) > max_model_len:
        raise ValidationError(f"tokens has {len(req.tokens)} entries, more than max_model_len "
                              f"({max_model_len})", param="tokens", value=len(req.tokens))
    vocab = _engine(raw).processor.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise ValidationError(f"tokens contains {bad[0]}, outside the vocabulary [0, {vocab})", param="tokens",
                              value=bad[0])
    return DetokenizeResponse(prompt=completion.tokenizer.decode(req.tokens)).model_dump()


async def on_request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    ours = (first.get("ctx") or {}).get("error")
    if isinstance(ours, ValidationError):  # a request model's own check (a model_validator): its words and param
        return _error(request, 400, ours.message, param=ours.param)
    param = _field_name(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        return _error(request, 400, f"request body is not valid JSON: {first.get('msg')}")
    if first.get("type") == "extra_forbidden":
        return _error(request, 400, f"{param} is not supported by this server (it is not ignored: the request is "
                                    "refused)", param=param)
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg", "invalid request"))
    return _error(request, 400, message, param=param)


async def on_validation(request: Request, exc: ValidationError) -> JSONResponse:
    return _error(request, 400, exc.message, param=exc.param)


async def on_model_not_found(request: Request, exc: ModelNotFoundError) -> JSONResponse:
    return _error(request, 404, str(exc), param=exc.param, code=exc.code)


async def on_response_not_found(request: Request, exc: ResponseNotFoundError) -> JSONResponse:
    return _error(request, 404, str(exc), param="response_id", code="not_found")


async def on_overloaded(request: Request, exc: OverloadedError) -> JSONResponse:
    response = _error(request, 503, str(exc), type_="server_error", code="overloaded")
    response.headers["Retry-After"] = str(exc.retry_after)
    return response


async def on_timeout(request: Request, exc: RequestTimeoutError) -> JSONResponse:
    return _error(request, 504, str(exc), type_="timeout_error", code="request_timeout")


async def on_request_failed(request: Request, exc: RequestFailedError) -> JSONResponse:
    return _error(request, 500, str(exc), type_="server_error", code="request_failed")


async def on_engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
    return _error(request, 503, str(exc), type_="server_error", code="engine_dead")  # (its message says why)


async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return _error(request, exc.status_code, str(exc.detail), code=str(exc.status_code))


async def on_engine_paused(request: Request, exc: EnginePausedError) -> JSONResponse:
    """A request while generation is paused (POST /pause): vLLM's retryable 503."""
    return JSONResponse({"error": {"message": str(exc), "type": "ServiceUnavailableError", "param": None,
                                   "code": 503}}, status_code=503, headers={"Retry-After": "1"})


async def on_collective_rpc(request: Request, exc: CollectiveRPCError) -> JSONResponse:
    return _error(request, 500, f"a worker method failed: {exc}", type_="server_error", code="collective_rpc_failed")


async def on_internal_error(request: Request, exc: Exception) -> JSONResponse:
    """Anything else: a 500 in OpenAI's shape, never uvicorn's plain text (starlette then re-raises it: the
    HTTPGuard, or uvicorn, logs the traceback)."""
    return _error(request, 500, "the server failed while handling this request (the error is in its log)",
                  type_="server_error", code="internal_error")


EXCEPTION_HANDLERS: dict[type[Exception], Callable[[Request, Any], Awaitable[JSONResponse]]] = {
    RequestValidationError: on_request_validation, ValidationError: on_validation,
    ModelNotFoundError: on_model_not_found, ResponseNotFoundError: on_response_not_found,
    OverloadedError: on_overloaded, RequestTimeoutError: on_timeout, RequestFailedError: on_request_failed,
    EngineDeadError: on_engine_dead, StarletteHTTPException: on_http, EnginePausedError: on_engine_paused,
    CollectiveRPCError: on_collective_rpc, Exception: on_internal_error}
"""Each error the endpoints raise -> its status and body (in the shape of the request's API: see _error)."""


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    engine = app.state.engine
    engine.start()
    yield
    await app.state.responses.close()  # background responses still running: cancelled, their requests aborted
    await engine.shutdown()  # in-flight requests that outlived the graceful period are aborted


def build_app(engine: AsyncLLM, metrics: ServerMetrics, served_model_names: list[str],
              api_keys: list[str], reasoning_parser: str | None = None,
              tool_call_parser: str | None = None, lora_modules: list[LoRAModulePath] | None = None,
              chat_template: str | None = None, limits: ServingLimits | None = None,
              allow_runtime_lora_updating: bool = False, model_aliases: list[str] | None = None,
              prompt_tokens_details: bool = False, return_tokens_as_token_ids: bool = False,
              trust_request_chat_template: bool = False, deploy: DeployOptions | None = None,
              force_include_usage: bool = False, reasoning_config: ReasoningConfig | None = None,
              per_request_metrics: bool = False, cohere: CohereChatOptions | None = None,
              enable_scale_out: bool = False, tokens_only: bool = False, stream_interval: int = 1,
              render_only: bool = False) -> FastAPI:
    """The FastAPI application around a (not yet started) async engine; ``lora_modules`` are read and checked
    here (ValidationError if one does not fit). ``prompt_tokens_details``: chat and completions usage report the
    prompt's prefix-cache hits (--enable-prompt-tokens-details); ``return_tokens_as_token_ids``: their logprobs
    name tokens "token_id:<id>" by default (--return-tokens-as-token-ids); ``deploy``: --root-path and vLLM's
    deployment routes' flags (deploy.py); ``force_include_usage``: streamed chat and completions replies carry
    usage in every chunk whatever their stream_options (--enable-force-include-usage); ``reasoning_config``:
    --reasoning-config's strings for thinking_token_budget; ``per_request_metrics``: chat and completions replies of
    one choice carry vLLM's timing ``metrics`` (--enable-per-request-metrics); ``cohere``: /cohere/v2/chat's flags;
    ``enable_scale_out`` / ``tokens_only``: vLLM's token-in/token-out routes (serving_tokens.py);
    ``stream_interval``: the fewest tokens a streamed chunk gathers (--stream-interval); ``render_only``: only the
    render, derender and tokenizer routes, for an engine with no core (`pagedllm launch render`)."""
    models = OpenAIServingModels(engine, served_model_names, model_aliases)
    models.add_static(lora_modules or [])
    chat = OpenAIServingChat(engine, models, get_reasoning_parser(reasoning_parser), get_tool_parser(tool_call_parser),
                             chat_template)
    chat.trust_request_chat_template = trust_request_chat_template  # --trust-request-chat-template
    chat.reasoning_config = reasoning_config or ReasoningConfig()  # --reasoning-config
    # the engine's --max-logprobs sizes the reply bound (limits.py): the limits carry it, resolved
    limits = dataclasses.replace(limits or ServingLimits(), max_logprobs=engine.config.model.max_logprobs)
    servings = _servings(engine, models, chat, chat_template, trust_request_chat_template)
    admission = Admission()  # one waiting count for every endpoint
    for serving in vars(servings).values():
        serving.limits = limits
        serving.prompt_tokens_details = prompt_tokens_details
        serving.return_tokens_as_token_ids = return_tokens_as_token_ids
        serving.force_include_usage = force_include_usage
        serving.stream_interval = stream_interval
        serving.per_request_metrics = per_request_metrics
        serving.on_refused = metrics.on_refused
        serving.admission = admission
    store = ResponseStore(limits.max_stored_responses, limits.max_stored_response_bytes, max(1, len(api_keys)))
    app = FastAPI(title="pagedllm", version=pagedllm.__version__, lifespan=lifespan)
    _set_state(app, engine, limits, metrics, models, servings, store, cohere)
    if render_only:
        _include_render_routes(app, api_keys, deploy)
    else:
        _include_routes(app, servings.tokens, api_keys, allow_runtime_lora_updating=allow_runtime_lora_updating,
                        enable_scale_out=enable_scale_out, tokens_only=tokens_only, deploy=deploy)
    return app


RENDER_SERVER_PATHS = frozenset({"/health", "/ping", "/version", "/v1/models", "/tokenize", "/detokenize"})
"""The main router's routes a render-only server keeps (besides the render and derender routes): what needs no
engine."""


def _include_render_routes(app: FastAPI, api_keys: list[str], deploy: DeployOptions | None) -> None:
    """A render-only server's routes (vLLM's `launch render`): health, models, tokenizer, render and derender;
    every generation route is absent (404). Of the deployment flags: --root-path, --enable-request-id-headers,
    --enable-tokenizer-info-endpoint (run_render_server refuses the others)."""
    app.router.routes.extend(r for r in router.routes if isinstance(r, APIRoute) and r.path in RENDER_SERVER_PATHS)
    app.include_router(render_router)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys)
    deploy = deploy or DeployOptions()
    if deploy.enable_tokenizer_info_endpoint:
        app.include_router(tokenizer_info_router)
    if deploy.root_path:
        app.root_path = deploy.root_path
    if deploy.enable_request_id_headers:
        app.add_middleware(RequestIdMiddleware)  # (after the key check: a refused request carries its id too)
    for exc_class, handler in EXCEPTION_HANDLERS.items():
        app.add_exception_handler(exc_class, handler)


def _include_routes(app: FastAPI, tokens: ServingTokens, api_keys: list[str], *, allow_runtime_lora_updating: bool,
                    enable_scale_out: bool, tokens_only: bool, deploy: DeployOptions | None) -> None:
    """The routes the flags turn on, the API-key check, the development and deployment routes, error handlers."""
    app.include_router(router)
    if enable_scale_out or tokens_only:  # (vLLM's render routes: 404 without either flag, as vLLM's)
        app.include_router(render_router)
    attach_tokens(app, tokens, enable_scale_out, tokens_only)  # (403 without either flag, as vLLM)
    if allow_runtime_lora_updating:
        logger.warning("run-time LoRA updating is on: any client that can reach /v1/load_lora_adapter may load an "
                       "adapter from any folder this server can read (use --api-key, and only on a trusted "
                       "network)")
        app.include_router(lora_router)
        app.include_router(sagemaker_lora_router)  # (SageMaker's POST /adapters, DELETE /adapters/{name})
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys)
    app.state.endpoints = types.SimpleNamespace(  # what /invocations routes to (deploy.py)
        chat_completions=chat_completions, completions=completions, embeddings=embeddings, classify=classify,
        score=score, rerank=rerank, pooling=pooling)
    app.state.endpoint_paths = {route.endpoint: route.path for route in router.routes  # (and whose errors they give)
                                if isinstance(route, APIRoute)}
    if dev_mode():  # vLLM's development routes (sleep, pause, collective_rpc): dev_routes.py
        attach_dev_routes(app)
    attach_deploy(app, deploy)  # (after the key check is added: its middleware wraps it)
    for exc_class, handler in EXCEPTION_HANDLERS.items():
        app.add_exception_handler(exc_class, handler)


def _servings(engine: AsyncLLM, models: OpenAIServingModels, chat: OpenAIServingChat, chat_template: str | None,
              trust_request_chat_template: bool) -> types.SimpleNamespace:
    """The endpoints' serving objects (chat's made by the caller, with its options)."""
    pooling = OpenAIServingPooling(engine, models)
    pooling.chat = chat  # messages inputs are rendered by the chat endpoint's template
    scoring = OpenAIServingGenerativeScoring(engine, models)
    decisions = OpenAIServingDecisions(scoring, chat_template)  # (reads through the scoring endpoint's read_labels)
    decisions.trust_request_chat_template = trust_request_chat_template
    return types.SimpleNamespace(completion=OpenAIServingCompletion(engine, models), chat=chat, pooling=pooling,
                                 scoring=scoring, decisions=decisions,
                                 tokens=ServingTokens(engine, models))  # vLLM's /inference/v1/generate


def _set_state(app: FastAPI, engine: AsyncLLM, limits: ServingLimits, metrics: ServerMetrics,
               models: OpenAIServingModels, servings: types.SimpleNamespace, store: ResponseStore,
               cohere: CohereChatOptions | None) -> None:
    """What the routes reach through request.app.state."""
    state = app.state
    state.engine, state.config, state.metrics, state.models = engine, engine.config, metrics, models
    state.limits = limits  # (the routes' body check reads its JSON bounds here)
    state.completion, state.chat, state.pooling = servings.completion, servings.chat, servings.pooling
    state.generative_scoring, state.decisions = servings.scoring, servings.decisions
    state.cohere_embed = CohereServingEmbed(servings.pooling)
    state.responses = OpenAIServingResponses(servings.chat, store)
    state.messages = AnthropicServingMessages(servings.chat)
    state.cohere_chat = CohereServingChat(servings.chat, cohere)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """`pagedllm serve`'s own flags (the engine's are added from EngineArgs: cli_args.py)."""
    _add_listen_args(parser)
    _add_admission_args(parser)
    _add_reply_args(parser)
    _add_route_args(parser)
    add_deploy_args(parser)
    add_limit_args(parser)
    add_http_args(parser)


def _add_listen_args(parser: argparse.ArgumentParser) -> None:
    """Where the server listens, who may call it and under which names."""
    parser.add_argument("model_tag", nargs="?", default=None, help="HF folder or .gguf file (default: SmolLM2)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--uds", default=None, metavar="PATH",
                        help="serve on this Unix domain socket instead of --host/--port (as vLLM's flag; a stale "
                             "socket file there is replaced, and the file is removed when the server exits)")
    parser.add_argument("--api-server-count", type=_positive(int), default=1, metavar="N",
                        help="API server processes in front of the one engine core (vLLM's flag): only 1 is "
                             "supported, a larger N is refused at start-up")
    parser.add_argument("--api-key", action="append", default=None,
                        help="accepted API key (repeatable); also read from PAGEDLLM_API_KEY")
    parser.add_argument("--served-model-name", action="append", default=None,
                        help="model name(s) clients use (default: the model argument's last path component; the "
                             "argument as given is accepted too)")
    parser.add_argument("--shutdown-timeout", type=float, default=5.0,
                        help="seconds in-flight requests may finish after SIGINT/SIGTERM before they are aborted")
    parser.add_argument("--uvicorn-log-level", default="info")


def _add_admission_args(parser: argparse.ArgumentParser) -> None:
    """What a request may cost the server: waiting, time, prompt bytes; the step log."""
    parser.add_argument("--max-waiting-requests", type=_positive(int), default=None, metavar="N",
                        help="refuse new requests with 503 and Retry-After while N requests wait for their first step "
                             "(default: no limit; the others are not disturbed)")
    parser.add_argument("--request-timeout", type=_positive(float), default=None, metavar="SECONDS",
                        help="abort a request still running after this long: 504, or an error event on a stream "
                             "(default: no limit)")
    parser.add_argument("--step-log", default=None, metavar="FILE",
                        help="append one JSON line per engine step (its features and seconds) to FILE: the "
                             "capacity planner's cost model fitted on steps as served (pagedllm plan --calibrate-from)")
    parser.add_argument("--max-prompt-bytes", type=_positive(int), default=None, metavar="BYTES",
                        help="refuse (400) prompt text over this many UTF-8 bytes before tokenizing it "
                             f"(default: {BYTES_PER_TOKEN_CAP} per token of max_model_len)")


def _add_reply_args(parser: argparse.ArgumentParser) -> None:
    """What the replies carry: reasoning and tool calls parsed, usage, token ids, timing, Cohere's plan."""
    parser.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                        help="split a reasoning model's <think>...</think> into the chat reply's reasoning_content")
    parser.add_argument("--reasoning-config", type=reasoning_config_arg, default=None, metavar="JSON",
                        help="vLLM's: {\"reasoning_start_str\": ..., \"reasoning_end_str\": ...}, the strings "
                             "thinking_token_budget opens and forces the end of the reasoning with (default: the "
                             "reasoning parser's <think> and </think>)")
    parser.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                        help="the model's tool-call format, parsed into tool_calls for tool_choice='auto'")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="chat and completions usage blocks report prompt_tokens_details.cached_tokens (the "
                             "prompt's tokens found in the prefix cache), as vLLM's flag; null without it")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="chat and completions logprobs name each token 'token_id:<id>' rather than its text "
                             "(a request's return_tokens_as_token_ids overrides it), as vLLM's flag")
    parser.add_argument("--stream-interval", type=_positive(int), default=1, metavar="N",
                        help="streamed replies send a chunk once N new tokens gathered (the first and last at once), "
                             "as vLLM's flag; a request's stream_interval may ask for more, never fewer")
    parser.add_argument("--enable-force-include-usage", action="store_true",
                        help="include usage on every request: each chunk of a streamed chat or completions reply "
                             "carries the usage so far and a last chunk the whole, as if its stream_options asked "
                             "for include_usage and continuous_usage_stats, as vLLM's flag")
    parser.add_argument("--enable-per-request-metrics", action="store_true",
                        help="a chat or completions reply of one choice carries vLLM's per-request timing as "
                             "\"metrics\" "
                             "(time_to_first_token_ms, generation_time_ms, queue_time_ms, mean_itl_ms, "
                             "tokens_per_second); a streamed one on its last (usage) chunk, as vLLM's flag")
    parser.add_argument("--cohere-is-reasoning-model", action=argparse.BooleanOptionalAction, default=True,
                        help="/cohere/v2/chat: the model's reasoning is a thinking content block (default); with "
                             "--no-cohere-is-reasoning-model it is the reply's tool_plan (a tool-plan-delta when "
                             "streamed), as older Command models plan before tool calls, as vLLM's flag")


def _add_route_args(parser: argparse.ArgumentParser) -> None:
    """The optional routes (scale-out, tokens only, run-time LoRA) and the chat template's sources."""
    parser.add_argument("--enable-scale-out", action="store_true",
                        help="serve vLLM's scale-out render routes, POST /v1/chat/completions/render, "
                             "/v1/completions/render, /v1/messages/render and /cohere/v2/chat/render (a request "
                             "checked and rendered, "
                             "not run: the /inference/v1/generate request that runs it) and the derender routes "
                             "POST /v1/chat/completions/derender and /v1/completions/derender (a generate reply's "
                             "tokens as the route's reply), and vLLM's "
                             "token-in/token-out POST /inference/v1/generate and /inference/v1/abort_requests (403 "
                             "without the flag)")
    parser.add_argument("--tokens-only", action="store_true",
                        help="as vLLM's flag: serve /inference/v1/generate and /inference/v1/abort_requests (and the "
                             "unauthenticated legacy POST /abort_requests) with detokenization off: output_mode "
                             "'text' and stop strings are refused (400)")
    parser.add_argument("--chat-template", type=read_chat_template, default=None, metavar="FILE",
                        help="a Jinja chat template (a file, or the template itself) used instead of the model's own")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="run a chat_template sent in a chat or /tokenize request (refused with a 400 without "
                             "it: a client's template runs on the server), as vLLM's flag")
    parser.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=None, metavar="NAME=PATH",
                        help="LoRA adapters (PEFT folders) served by name: a request whose model is NAME runs with "
                             "it; also vLLM's JSON form '{\"name\": ..., \"path\": ...}' (needs --enable-lora)")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter: any client may then load an "
                             f"adapter from any folder the server can read (also {RUNTIME_LORA_ENV}=1; needs "
                             "--enable-lora; --lora-modules adapters stay the operator's)")


def read_chat_template(value: str) -> str:
    """--chat-template: a file's text, or the argument itself when it is a template (has "{%" or "{{")."""
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if "{%" in value or "{{" in value:
        return value
    raise argparse.ArgumentTypeError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


class _Server(GuardedServer):
    """uvicorn's graceful shutdown on SIGINT/SIGTERM (past --shutdown-timeout, what still runs ends in OpenAI's
    shape: see http_guard), then exit status 0.

    uvicorn's own ``capture_signals`` re-raises the caught signal once the server has shut down
    (the process then dies "of" SIGTERM); a server that shut down cleanly on request should exit
    0 instead. This one routes the same signals to uvicorn's ``handle_exit`` (first: graceful
    shutdown; a second SIGINT: force exit), restores the previous handlers, and re-raises nothing.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # handlers can only be set from the main thread (uvicorn does the same)
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _SHUTDOWN_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def remove_socket_file(path: str | None) -> None:
    """Remove the Unix socket file of --uds that the server listened on (nothing else: a regular file there is the
    operator's, and uvicorn refused to bind over it)."""
    if path is not None and os.path.exists(path) and stat.S_ISSOCK(os.stat(path).st_mode):
        os.unlink(path)


def engine_core_process() -> bool:
    """Whether `pagedllm serve` runs the engine core in its own process: yes unless
    PAGEDLLM_ENABLE_MULTIPROCESSING=0 (vLLM's VLLM_ENABLE_V1_MULTIPROCESSING), which keeps it a thread."""
    return envs.ENABLE_MULTIPROCESSING.read()


@dataclass
class ServerSetup:
    """What `pagedllm serve`'s flags decide before the engine loads (shared with `pagedllm run-batch`)."""

    names: list[str]
    """The served model names (the first is the one replies carry)."""
    aliases: list[str]
    """Other names a request may give (the model argument as given, when no --served-model-name)."""
    keys: list[str]
    """Accepted API keys (none: no key needed)."""
    allow_lora_updating: bool


def reasoning_config_arg(value: str) -> ReasoningConfig:
    """--reasoning-config's JSON (argparse's error names what is wrong)."""
    try:
        return parse_reasoning_config(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def server_setup(ns: argparse.Namespace, engine_args: EngineArgs) -> ServerSetup:
    """The names, keys and adapter settings of a `pagedllm serve` command line (ValidationError for flags that do
    not go together), before anything is loaded."""
    model = engine_args.model or DEFAULT_MODEL_NAME
    names = ns.served_model_name or [public_name(model)]  # (no filesystem path shown in /v1/models)
    aliases = [] if ns.served_model_name else [model]  # a request naming the path as given is still served
    if ns.lora_modules and not engine_args.enable_lora:
        raise ValidationError("--lora-modules needs --enable-lora", param="lora_modules",
                              value=[m.name for m in ns.lora_modules])
    allow_lora_updating = runtime_lora_updating(ns.allow_runtime_lora_updating)
    if allow_lora_updating and not engine_args.enable_lora:
        raise ValidationError(f"--allow-runtime-lora-updating ({RUNTIME_LORA_ENV}) needs --enable-lora",
                              param="allow_runtime_lora_updating", value=True)
    if ns.api_server_count != 1:
        raise ValidationError(f"--api-server-count {ns.api_server_count}: pagedllm serve runs one API server process "
                              "in front of its engine core (the core takes one client); use --api-server-count 1, "
                              "or --data-parallel-size for more engine throughput", param="api_server_count",
                              value=ns.api_server_count)
    keys = ns.api_key or ([envs.API_KEY.read()] if envs.API_KEY.read() else [])
    deploy_options(ns)  # (a bad --root-path is refused before the engine loads)
    if ns.reasoning_config is not None:
        try:
            ns.reasoning_config.check_parser(ns.reasoning_parser)
        except ValueError as e:
            raise ValidationError(str(e), param="reasoning_config") from None
    return ServerSetup(names, aliases, keys, allow_lora_updating)


def app_from_args(ns: argparse.Namespace, engine: AsyncLLM, metrics: ServerMetrics, setup: ServerSetup,
                  render_only: bool = False) -> FastAPI:
    """build_app with everything a `pagedllm serve` command line sets (the server's and run-batch's one app)."""
    return build_app(engine, metrics, setup.names, setup.keys, ns.reasoning_parser, ns.tool_call_parser,
                     ns.lora_modules, ns.chat_template, serving_limits(ns),
                     allow_runtime_lora_updating=setup.allow_lora_updating,
                     model_aliases=setup.aliases, prompt_tokens_details=ns.enable_prompt_tokens_details,
                     return_tokens_as_token_ids=ns.return_tokens_as_token_ids,
                     trust_request_chat_template=ns.trust_request_chat_template,
                     deploy=deploy_options(ns), force_include_usage=ns.enable_force_include_usage,
                     reasoning_config=ns.reasoning_config, per_request_metrics=ns.enable_per_request_metrics,
                     cohere=CohereChatOptions(ns.cohere_is_reasoning_model),
                     enable_scale_out=ns.enable_scale_out, tokens_only=ns.tokens_only,
                     stream_interval=ns.stream_interval, render_only=render_only)


def run_render_server(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    """`pagedllm launch render`: serve the render, derender and tokenizer routes with no engine (the model's
    configuration and tokenizer only: no weights, no KV cache) until SIGINT/SIGTERM; returns the exit status."""
    from pagedllm.engine.render_client import RenderOnlyClient

    for flag, value in (("lora_modules", ns.lora_modules), ("allow_runtime_lora_updating",
                                                             ns.allow_runtime_lora_updating),
                        ("enable_sagemaker_sessions", ns.enable_sagemaker_sessions),
                        ("enable_server_load_tracking", ns.enable_server_load_tracking)):
        if value:  # (what needs an engine or a generation route: refused, not silently dropped)
            raise ValidationError(f"--{flag.replace('_', '-')} is not served by a render-only server "
                                  "(pagedllm launch render): it runs no engine", param=flag)
    setup = server_setup(ns, engine_args)
    engine = AsyncLLM(RenderOnlyClient(engine_args))
    app = app_from_args(ns, engine, ServerMetrics(setup.names[0]), setup, render_only=True)
    config, guard = serve_config(app, ns)
    try:
        _Server(config, guard, ns.shutdown_timeout).run()
    finally:
        engine.close()
        remove_socket_file(ns.uds)
    return 0


def run_server(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    """Load the engine, then serve until SIGINT/SIGTERM; returns the exit status."""
    setup = server_setup(ns, engine_args)
    names = setup.names
    local_core.raise_open_file_limit()  # each connection is a file; before the engine starts: its processes inherit it
    if not engine_core_process() or engine_args.data_parallel_size != 1:
        local_core.release()  # the core the CLI started first is not how this engine runs
    metrics = ServerMetrics(names[0], engine_args.data_parallel_size)
    server: _Server | None = None

    def on_dead(error: BaseException) -> None:  # on the event loop: /health already says 503
        logger.error("the engine died (%s); the server exits with status 1 in %.0f s", error, DEAD_EXIT_DELAY_S)
        timer = threading.Timer(DEAD_EXIT_DELAY_S, lambda: setattr(server, "should_exit", True))
        timer.daemon = True
        timer.start()

    engine = AsyncLLM.from_engine_args(engine_args, on_step=metrics.on_step, on_dead=on_dead, step_log=ns.step_log,
                                       multiprocess=engine_core_process())
    metrics.engine_loaded(engine.config, engine.num_kv_blocks)  # (vllm:cache_config_info, token histograms)
    try:
        app = app_from_args(ns, engine, metrics, setup)
    except BaseException:
        engine.close()  # an adapter that does not fit: no worker left behind
        raise
    config, guard = serve_config(app, ns)
    server = _Server(config, guard, ns.shutdown_timeout)
    try:
        server.run()
    finally:
        engine.close()  # also when uvicorn could not start (port in use): no worker left behind
        remove_socket_file(ns.uds)
    return 1 if engine.dead_error is not None else 0
