"""http_guard.HTTPGuard in process (no server): a failure escaping the app never leaves as plain text or as a
stream cut short, past the shutdown grace period what still runs ends in OpenAI's shape, and a request over the
cap on requests in flight is a 503 in its API's shape."""
from __future__ import annotations

import asyncio
import json
from typing import Any

from pagedllm.entrypoints.openai.http_guard import HTTPGuard

SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}


async def _call(guard: HTTPGuard, during: Any = None) -> list[dict]:
    """The messages the guard sends for one request (``during``: a coroutine function run while it runs)."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    task = asyncio.ensure_future(guard(SCOPE, receive, send))
    if during is not None:
        await during()
    await asyncio.wait_for(task, 5)
    return sent


def _status_and_body(sent: list[dict]) -> tuple[int, bytes]:
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


async def _fails(scope: Any, receive: Any, send: Any) -> None:
    raise RuntimeError("a bug")


async def _fails_mid_stream(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await send({"type": "http.response.body", "body": b'data: {"x": 1}\n\n', "more_body": True})
    raise RuntimeError("a bug")


async def _runs_forever(scope: Any, receive: Any, send: Any) -> None:
    await asyncio.sleep(3600)


def test_a_failure_escaping_the_app_is_a_json_500() -> None:
    status, body = _status_and_body(asyncio.run(_call(HTTPGuard(_fails))))
    assert status == 500
    assert json.loads(body)["error"]["code"] == "internal_error"


def test_a_stream_that_fails_ends_with_an_error_event_and_done() -> None:
    status, body = _status_and_body(asyncio.run(_call(HTTPGuard(_fails_mid_stream))))
    events = [e for e in body.decode().split("\n\n") if e]
    assert status == 200 and events[0] == 'data: {"x": 1}'
    assert json.loads(events[1].removeprefix("data: "))["error"]["type"] == "server_error"
    assert events[2] == "data: [DONE]"


def test_past_the_shutdown_grace_period_a_running_request_is_a_503() -> None:
    guard = HTTPGuard(_runs_forever)

    async def expire() -> None:
        await asyncio.sleep(0.05)
        guard.expire(1.0)

    status, body = _status_and_body(asyncio.run(_call(guard, expire)))
    assert status == 503 and json.loads(body)["error"]["code"] == "server_shutdown"
    # and a request arriving after that is refused the same way
    status, _ = _status_and_body(asyncio.run(_call(guard)))
    assert status == 503


def _body_of(size: int, chunks: int, declared: bool) -> tuple[dict, Any]:
    """(scope, receive) of a POST whose body is ``size`` bytes in ``chunks`` messages."""
    headers = [(b"content-length", str(size).encode())] if declared else []
    parts = [b"x" * (size // chunks)] * chunks
    messages = iter([{"type": "http.request", "body": p, "more_body": i < chunks - 1} for i, p in enumerate(parts)])

    async def receive() -> dict:
        return next(messages, {"type": "http.disconnect"})

    return {**SCOPE, "headers": headers}, receive


async def _reads_body(scope: Any, receive: Any, send: Any) -> None:
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(len(body)).encode()})


def test_a_body_over_the_cap_is_a_413_before_it_is_read_whole() -> None:
    guard = HTTPGuard(_reads_body, max_body_bytes=1000)
    for size, chunks, declared, status in ((1000, 2, True, 200), (1001, 1, True, 413), (4000, 4, False, 413),
                                           (1000, 4, False, 200)):
        scope, receive = _body_of(size, chunks, declared)
        sent: list[dict] = []

        async def send(message: dict, sent: list[dict] = sent) -> None:
            sent.append(message)

        asyncio.run(guard(scope, receive, send))
        got, body = _status_and_body(sent)
        assert got == status, (size, chunks, declared, got)
        if status == 413:
            assert json.loads(body)["error"]["code"] == "body_too_large"


def test_the_cap_on_requests_in_flight_answers_in_each_apis_shape() -> None:
    """A request over --limit-concurrency gets a 503 with Retry-After in its API's shape: OpenAI's, and on
    /v1/messages Anthropic's (overloaded_error), as the README says."""
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.http_guard import EdgeCounts, EveryInterval, _GuardedProtocol

    counts = EdgeCounts()
    counts.in_flight = 2
    protocol = SimpleNamespace(counts=counts, max_in_flight=2, refused=EveryInterval("%d %d"),
                               _cancel_header_timer=lambda: None)

    async def refused(path: str) -> list[dict]:
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        await _GuardedProtocol._admit(protocol, {**SCOPE, "path": path}, None, send)
        return sent

    for path in ("/v1/completions", "/v1/messages"):
        sent = asyncio.run(refused(path))
        status, body = _status_and_body(sent)
        assert status == 503 and (b"retry-after", b"1") in sent[0]["headers"]
        error = json.loads(body)
        if path == "/v1/messages":
            assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
            assert error["error"]["type"] == "overloaded_error" and "--limit-concurrency" in error["error"]["message"]
        else:
            assert error["error"]["code"] == "too_many_connections"
    assert counts.in_flight == 2  # a refusal takes no slot
