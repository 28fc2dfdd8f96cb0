"""The HTTP edge of ``pagedllm serve``: what keeps slow, many or careless clients from taking the server down.

- ``--header-timeout``: a connection that has not sent a request's complete headers within that many
  seconds of opening (or of its first bytes after the previous response) is closed (slowloris).
- ``--body-timeout``: a request whose whole body has not arrived within that many seconds of its headers
  gets 408 in OpenAI's shape and its connection is closed.
- ``--max-body-bytes``: a request body over that many bytes gets 413 in OpenAI's shape before it is read
  (by its Content-Length) or as soon as it passes the bound (a chunked body): no body is held whole past it.
- ``--limit-concurrency``: over that many requests in flight (their headers in, their response not yet
  complete) a request is answered 503 in OpenAI's shape, with Retry-After, and its connection closed
  (uvicorn's own answer is plain text). Idle connections are not requests: they are not counted here.
- ``--max-connections-per-client``: a connection from an address that already holds that many is closed
  as soon as it is accepted (one log line a minute), so that one address cannot hold every file descriptor.
- The soft open-file limit is raised to the hard one at start; at the limit, ``accept()`` fails and asyncio
  would log a traceback per attempt (thousands a second): one line a minute instead, while the admitted
  requests go on and new connections wait in the listen backlog.
- Past ``--shutdown-timeout``, a request still running ends in OpenAI's shape: 503, or on a stream an error
  event and ``data: [DONE]`` (uvicorn would cancel it: a plain-text 500, or a stream cut short).
- No error leaves as plain text: a failure escaping the app, and uvicorn's 400 for bytes that are not HTTP,
  are JSON bodies too; a lone surrogate in any string of a JSON body is a 400 naming the field.
- "OpenAI's shape" above is the request's API's: on ``/v1/messages`` Anthropic's error body, and its
  ``event: error`` ending a stream; on a ``/v1/responses`` stream the Responses API's error event (numbered
  after the last event sent), without [DONE].
"""
from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import math
import re
import resource
import time
from collections.abc import Callable, Coroutine
from typing import Any

import uvicorn
from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from pagedllm.entrypoints.anthropic.protocol import anthropic_error
from pagedllm.entrypoints.openai.json_scan import check_json_shape
from pagedllm.errors import ValidationError

logger = logging.getLogger("pagedllm.server")

DEFAULT_HEADER_TIMEOUT = 10.0
"""Seconds a connection has to send a request's headers (Go's ReadHeaderTimeout in spirit: a few KB over any
link, so only a slowloris client is cut off)."""
DEFAULT_BODY_TIMEOUT = 60.0
"""Seconds a request has to send its whole body once its headers are in (the largest prompt the byte cap
allows, over a slow link)."""
DEFAULT_MAX_BODY_BYTES = 16 * 2**20
"""Bytes of one request body by default: room for the largest prompt the default byte cap allows (64 bytes per
token of a 128k context, 8 MiB) with JSON's escapes, plus tools and schemas at their caps."""
DEFAULT_LIMIT_CONCURRENCY = 4096
"""Requests in flight at once by default; lowered to half the open-file limit where that is lower, so the cap
answers 503 before the requests' own connections take every file descriptor."""
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 1024
"""Open connections of one client address by default: above the concurrency of a benchmark client or of a
reverse proxy (one connection per request it forwards; raise it behind a busier proxy), yet an attacker
needs many addresses to hold the ~1M descriptors of a typical hard open-file limit."""
SHUTDOWN_BACKSTOP_S = 2.0
"""uvicorn's own cancellation comes this long after ours, for a request that ignored ours."""
LOG_INTERVAL_S = 60.0
"""The repeated warnings of the edge (accept failing at the fd limit, connections refused or cut) are logged
at most once per this many seconds each."""
_ACCEPT_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
"""What asyncio reports as "socket.accept() out of system resource"."""


def positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: a number of ``kind`` above 0."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not value > 0 or (isinstance(value, float) and not math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
        return value
    return parse


def add_http_args(parser: argparse.ArgumentParser) -> None:
    """The connection flags of ``pagedllm serve``."""
    group = parser.add_argument_group("connections (slow and many clients)")
    group.add_argument("--header-timeout", type=positive(float), default=DEFAULT_HEADER_TIMEOUT, metavar="SECONDS",
                       help="close a connection that has not sent a request's complete headers this long after it "
                            "opened, or after its first bytes following a response "
                            f"(default: {DEFAULT_HEADER_TIMEOUT:g})")
    group.add_argument("--body-timeout", type=positive(float), default=DEFAULT_BODY_TIMEOUT, metavar="SECONDS",
                       help="answer 408 and close the connection when a request's whole body has not arrived this "
                            f"long after its headers (default: {DEFAULT_BODY_TIMEOUT:g})")
    group.add_argument("--max-body-bytes", type=positive(int), default=DEFAULT_MAX_BODY_BYTES, metavar="BYTES",
                       help="answer 413 to a request body over this many bytes, before reading it whole "
                            f"(default: {DEFAULT_MAX_BODY_BYTES})")
    group.add_argument("--limit-concurrency", type=positive(int), default=None, metavar="N",
                       help="over N requests in flight (idle connections do not count), answer 503 with Retry-After "
                            f"and close the connection (default: {DEFAULT_LIMIT_CONCURRENCY}, or half the open-file "
                            "limit if that is lower)")
    group.add_argument("--max-connections-per-client", type=positive(int), default=DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
                       metavar="N", help="close a new connection at once when its client address already holds N "
                                         f"open connections (default: {DEFAULT_MAX_CONNECTIONS_PER_CLIENT})")


class EveryInterval:
    """A warning logged at most once per ``interval`` seconds; each line counts the events it stands for."""

    def __init__(self, message: str, interval: float = LOG_INTERVAL_S) -> None:
        self.message = message
        self.interval = interval
        self.count = 0
        self.last = -math.inf

    def warn(self, *args: Any) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last < self.interval:
            return
        logger.warning(self.message + " [%d such event(s) since the last line; at most one line a minute]",
                       *args, self.count)
        self.last, self.count = now, 0


def connection_cap(limit: int | None) -> int:
    """``--limit-concurrency``, or its default under the current open-file limit."""
    if limit is not None:
        return limit
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return DEFAULT_LIMIT_CONCURRENCY if soft == resource.RLIM_INFINITY else \
        max(1, min(DEFAULT_LIMIT_CONCURRENCY, soft // 2))


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """At the fd limit, asyncio's accept loop reports every failed ``accept()`` with a traceback (it retries
    up to the backlog's length per wake-up, thousands a second): one warning line a minute instead. Every
    other report goes to the handler that was there."""
    previous = loop.get_exception_handler()
    warning = EveryInterval("cannot accept new connections: %s (open-file limit %d); they wait in the listen "
                            "backlog while the admitted requests go on")

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        if isinstance(error, OSError) and error.errno in _ACCEPT_ERRNOS and "accept" in context.get("message", ""):
            warning.warn(error.strerror, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


ANTHROPIC_PATHS = ("/v1/messages",)
"""Paths whose errors take Anthropic's shape."""
COHERE_PATHS = ("/cohere/",)
"""Paths whose errors take Cohere's shape ({"message": ...}) and whose streams end in Cohere's message-end."""
RESPONSES_PATHS = ("/v1/responses",)
"""Paths whose streams end in the Responses API's error event."""
_SEQUENCE = re.compile(rb'"sequence_number":\s*(\d+)')
"""A Responses stream event's number, as its events are written (serving_responses._EventWriter)."""


def error_json(message: str, type_: str, code: str | None, param: str | None = None, status: int = 500,
               path: str = "") -> bytes:
    """The error body of ``path``'s API, as bytes: Anthropic's on the Messages API ({"type": "error", "error":
    {"type", "message"}}, its type from ``status``), OpenAI's elsewhere (the Responses API's too)."""
    if path.startswith(ANTHROPIC_PATHS):
        return json.dumps(anthropic_error(status, message)).encode()
    if path.startswith(COHERE_PATHS):
        return json.dumps({"message": message}).encode()
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


def stream_error(status: int, message: str, type_: str, code: str | None, path: str = "",
                 last_sequence: int = -1) -> bytes:
    """The end of a stream already begun, in ``path``'s API: Anthropic's error event; the Responses API's error
    event, numbered after ``last_sequence``; elsewhere OpenAI's error chunk and [DONE]."""
    if path.startswith(ANTHROPIC_PATHS):
        return b"event: error\ndata: " + error_json(message, type_, code, None, status, path) + b"\n\n"
    if path.startswith(COHERE_PATHS):
        event = {"type": "message-end", "delta": {"error": message, "finish_reason": "ERROR"}}
        return b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n"
    if path.startswith(RESPONSES_PATHS):
        event = {"type": "error", "sequence_number": last_sequence + 1, "code": code, "message": message,
                 "param": None}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"
    return b"data: " + error_json(message, type_, code) + b"\n\ndata: [DONE]\n\n"


async def send_error(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """A whole JSON error response, closing the connection after it."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


# ---------------------------------------------------------------------------------------------- connections


class EdgeCounts:
    """What every connection of one server shares: its requests in flight and its open connections by client
    address (the event loop alone touches them: no lock)."""

    def __init__(self) -> None:
        self.in_flight = 0
        """Requests admitted (headers in) whose app has not returned: what --limit-concurrency bounds."""
        self.by_client: dict[str, int] = {}
        """Open connections per client address (an address leaves the dict at 0: it cannot grow without bound)."""


class _GuardedProtocol:
    """Mixed in before uvicorn's HTTP protocol (h11 or httptools): the header timeout, the cap on requests in
    flight answered in OpenAI's shape, the cap on one address's connections, and a JSON 400 for bytes that are
    not HTTP. Only what both protocols share is used: ``app`` (the ASGI app a request runs; this one admits it
    first), ``cycle``, ``transport``, ``loop``, ``client``."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    max_in_flight: int = DEFAULT_LIMIT_CONCURRENCY
    max_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT
    counts: EdgeCounts
    cut = EveryInterval("closed a connection that sent no complete request headers within %g s (--header-timeout)")
    refused = EveryInterval("refused a request: %d requests in flight, at --limit-concurrency %d")
    crowded = EveryInterval("closed a new connection from %s: it holds %d, --max-connections-per-client")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._app = self.app
        self.app = self._admit
        self._header_timer: asyncio.TimerHandle | None = None
        self._client_host: str | None = None
        """The address this connection is counted under in ``counts.by_client`` (None: not counted)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        host = self.client[0] if self.client else None  # None on a Unix socket: nothing to count
        if host is not None:
            held = self.counts.by_client.get(host, 0)
            if held >= self.max_per_client:
                self.crowded.warn(host, held)
                transport.abort()  # at once, nothing written or read: the cheapest answer (connection_lost follows)
                return
            self.counts.by_client[host] = held + 1
            self._client_host = host
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm_header_timer()  # a kept-alive connection's next request begins
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        if self._client_host is not None:
            left = self.counts.by_client[self._client_host] - 1
            if left:
                self.counts.by_client[self._client_host] = left
            else:
                del self.counts.by_client[self._client_host]
            self._client_host = None
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are not an HTTP request, in OpenAI's shape."""
        body = error_json(f"{msg} (the bytes received are not an HTTP/1.1 request)", "invalid_request_error", None)
        self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
        self.transport.close()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.cut.warn(self.header_timeout)
            self.transport.close()

    async def _admit(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Each request's headers are in: serve it, or refuse it when ``max_in_flight`` requests already run.
        The count is kept here, by this server's own admissions, so a burst over the cap refuses exactly the
        excess (uvicorn's sets of connections and tasks also hold idle and finishing ones)."""
        self._cancel_header_timer()
        counts = self.counts
        if counts.in_flight >= self.max_in_flight:
            self.refused.warn(counts.in_flight, self.max_in_flight)
            message = (f"the server is at its limit of {self.max_in_flight} requests in flight "
                       "(--limit-concurrency); retry in a moment")
            body = error_json(message, "server_error", "too_many_connections", None, 503, scope.get("path", ""))
            await send_error(send, 503, body, [(b"retry-after", b"1")])  # (in the API's shape: Anthropic's 503)
            return
        counts.in_flight += 1
        try:
            await self._app(scope, receive, send)
        finally:
            counts.in_flight -= 1


def guarded_protocol(header_timeout: float, max_in_flight: int,
                     max_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
                     base: type[asyncio.Protocol] = AutoHTTPProtocol) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (``base``: h11, or httptools where installed) with the guard mixed in; each
    class counts its own server's requests and connections."""
    return type("GuardedHTTPProtocol", (_GuardedProtocol, base),
                {"header_timeout": header_timeout, "max_in_flight": max_in_flight,
                 "max_per_client": max_per_client, "counts": EdgeCounts()})


# ------------------------------------------------------------------------------------------------- requests


class _Exchange:
    """One request's ``receive`` and ``send`` as the app sees them: its body bounded in time, the response's
    progress followed, so that the guard can still end it in its API's shape."""

    def __init__(self, receive: Receive, send: Send, body_timeout: float,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, path: str = "") -> None:
        self.path = path
        """The request's path: its errors take that API's shape."""
        self.last_sequence = -1
        """On a Responses stream, the number of the last event sent (an error event follows it)."""
        self._receive = receive
        self._send = send
        self._loop = asyncio.get_running_loop()
        self.body_deadline = self._loop.time() + body_timeout
        self.body_timeout = body_timeout
        self.max_body_bytes = max_body_bytes
        self.body_bytes = 0
        self.body_done = False
        self.started = False
        self.streaming = False
        """The response is a server-sent event stream (an error ends it as an event, then [DONE])."""
        self.complete = False
        self.ended = False
        """The guard ended the response: what the app sends from then on is dropped."""

    async def receive(self) -> Message:
        if self.body_done:
            return await self._receive()
        try:
            message = await asyncio.wait_for(self._receive(), max(0.0, self.body_deadline - self._loop.time()))
        except asyncio.TimeoutError:  # TimeoutError's alias from 3.11
            await self.end(408, f"the request body did not arrive within {self.body_timeout:g} s (--body-timeout)",
                           "invalid_request_error", "body_timeout")
            return {"type": "http.disconnect"}
        self.body_done = message["type"] != "http.request" or not message.get("more_body", False)
        if message["type"] == "http.request":
            self.body_bytes += len(message.get("body", b""))
            if self.body_bytes > self.max_body_bytes:
                await self.too_large()
                return {"type": "http.disconnect"}
        return message

    async def too_large(self) -> None:
        """413 in the API's shape: the body is over --max-body-bytes."""
        await self.end(413, f"the request body is over {self.max_body_bytes} bytes (--max-body-bytes)",
                       "invalid_request_error", "body_too_large")

    async def send(self, message: Message) -> None:
        if self.ended:
            return
        if message["type"] == "http.response.start":
            self.started = True
            content_type = dict(message.get("headers", ())).get(b"content-type", b"")
            self.streaming = content_type.startswith(b"text/event-stream")
        elif message["type"] == "http.response.body":
            self.complete = not message.get("more_body", False)
            if self.streaming and self.path.startswith(RESPONSES_PATHS):
                numbers = _SEQUENCE.findall(message.get("body", b""))
                self.last_sequence = int(numbers[-1]) if numbers else self.last_sequence
        await self._send(message)

    async def end(self, status: int, message: str, type_: str, code: str) -> None:
        """End the response with this error in its API's shape: the whole JSON response if none started, the
        API's error event on a stream (see stream_error), else the end of the body; the connection closes
        after it."""
        if self.complete or self.ended:
            return
        self.ended = True
        if not self.started:
            await send_error(self._send, status, error_json(message, type_, code, None, status, self.path))
        elif self.streaming:
            await self._send({"type": "http.response.body",
                              "body": stream_error(status, message, type_, code, self.path, self.last_sequence)})
        else:
            await self._send({"type": "http.response.body", "body": b""})
        self.complete = True


SHUTDOWN_MESSAGE = "the server is shutting down and the request did not finish within --shutdown-timeout ({:g} s)"


class HTTPGuard:
    """ASGI wrapper of the whole app: each request's body within --body-timeout; past the shutdown grace period
    every request still running ends in its API's shape; a failure escaping the app never leaves as plain text
    (nor cuts a stream without an error event and [DONE])."""

    def __init__(self, app: ASGIApp, body_timeout: float = DEFAULT_BODY_TIMEOUT,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.body_timeout = body_timeout
        self.max_body_bytes = max_body_bytes
        self.shutdown_timeout = 0.0
        self.expired = False
        self._running: set[asyncio.Task] = set()

    def expire(self, shutdown_timeout: float) -> None:
        """The shutdown grace period is over: every request still running ends now (503, or on a stream an
        error event and [DONE]); its handler is cancelled, so its engine requests are aborted."""
        self.expired = True
        self.shutdown_timeout = shutdown_timeout
        for task in self._running:
            task.cancel()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        exchange = _Exchange(receive, send, self.body_timeout, self.max_body_bytes, scope.get("path", ""))
        if self.expired:
            await exchange.end(503, *self._shutdown_error())
            return
        length = dict(scope.get("headers", ())).get(b"content-length")  # (the HTTP parser checked its form)
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await exchange.too_large()  # before a byte of the body is read
            return
        work = asyncio.ensure_future(self.app(scope, exchange.receive, exchange.send))
        self._running.add(work)
        try:
            await asyncio.wait({work})
        finally:
            self._running.discard(work)
            if not work.done():  # uvicorn's own cancellation reached this request: its handler goes too
                work.cancel()
        error = None if work.cancelled() else work.exception()
        if error is not None:  # the app's catch-all handler answered it if it could; here it is logged, once
            logger.error("%s %s failed", scope.get("method"), scope.get("path"), exc_info=error)
        if self.expired:
            await exchange.end(503, *self._shutdown_error())
        elif error is not None:
            await exchange.end(500, "the server failed while handling this request (the error is in its log)",
                               "server_error", "internal_error")

    def _shutdown_error(self) -> tuple[str, str, str]:
        """(message, type, code) of a request ended by the shutdown."""
        return SHUTDOWN_MESSAGE.format(self.shutdown_timeout), "server_error", "server_shutdown"


class GuardedServer(uvicorn.Server):
    """uvicorn's server with the edge's loop handler (quiet accept failures) and the end of the shutdown grace
    period handed to the ``HTTPGuard`` (uvicorn itself would cancel what is left a little later)."""

    def __init__(self, config: uvicorn.Config, guard: HTTPGuard, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.guard = guard
        self.shutdown_timeout = shutdown_timeout

    async def startup(self, sockets: Any = None) -> None:
        quiet_accept_errors(asyncio.get_running_loop())
        await super().startup(sockets=sockets)

    async def shutdown(self, sockets: Any = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, self.guard.expire,
                                                      self.shutdown_timeout)
        try:
            await super().shutdown(sockets=sockets)
        finally:
            timer.cancel()


def serve_config(app: ASGIApp, ns: argparse.Namespace) -> tuple[uvicorn.Config, HTTPGuard]:
    """uvicorn's config for ``pagedllm serve`` (the app behind the guard, the guarded protocol) and the guard."""
    guard = HTTPGuard(app, ns.body_timeout, ns.max_body_bytes)
    # loop="asyncio", whatever else is installed: uvicorn's "auto" takes uvloop when present, which reports a
    # failed accept (EMFILE) without asyncio's exception handler, so quiet_accept_errors would never see it
    config = uvicorn.Config(guard, host=ns.host, port=ns.port, uds=ns.uds,  # --uds: host and port unused
                            log_level=ns.uvicorn_log_level, loop="asyncio",
                            http=guarded_protocol(ns.header_timeout, connection_cap(ns.limit_concurrency),
                                                  ns.max_connections_per_client),
                            timeout_graceful_shutdown=ns.shutdown_timeout + SHUTDOWN_BACKSTOP_S)
    return config, guard


# ------------------------------------------------------------------------------------------- invalid Unicode

_SURROGATE = re.compile("[\ud800-\udfff]")
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\xed[\xa0-\xbf]")
"""A JSON body that can decode to a lone surrogate holds one of these: an escape in U+D800..U+DFFF (a valid
pair matches too, and decodes to one character) or its raw UTF-8-style bytes (which json.loads lets through)."""


def lone_surrogate_path(value: Any) -> str | None:
    """The path (``messages[0].content``) of the first string in parsed JSON holding a lone surrogate, if any."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:  # iterative: a body may nest as deep as json.loads allows
        item, path = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path or "body"
        elif isinstance(item, dict):
            for key in item:
                if _SURROGATE.search(key):
                    return path or "body"
            stack.extend((v, f"{path}.{k}" if path else k) for k, v in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(item))))
    return None


class UnicodeCheckedRoute(APIRoute):
    """A route whose JSON body is refused (400 naming the field) when a string in it is not valid Unicode (a
    lone surrogate such as ``"\\ud800"``, which no tokenizer or encoder takes), before the endpoint runs; and,
    before it is parsed at all, when it holds more JSON values or nests deeper than the app's ServingLimits
    (``app.state.limits``: --max-json-values, --max-json-depth; see json_scan.py). The body is parsed once:
    FastAPI reuses the request's parsed JSON."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def checked(request: Request) -> Response:
            try:
                body = await request.body()
            except ClientDisconnect:  # gone (or cut off at --body-timeout, already answered 408)
                return Response(status_code=400)
            limits = getattr(request.app.state, "limits", None)
            if limits is not None:  # json.loads and pydantic would hold the loop in proportion to the values
                await check_json_shape(body, limits.max_json_values, limits.max_json_depth)
            if _MAYBE_SURROGATE.search(body):
                try:
                    parsed = await request.json()
                except (ValueError, RecursionError):
                    parsed = None  # not JSON: FastAPI's own parse answers it
                path = lone_surrogate_path(parsed)
                if path is not None:
                    raise ValidationError(f"{path} is not valid Unicode: it holds a lone UTF-16 surrogate (text "
                                          "must be valid UTF-8)", param=path)
            return await handle(request)

        return checked
