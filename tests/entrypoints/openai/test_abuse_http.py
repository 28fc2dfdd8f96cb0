"""The HTTP edge of a real `pagedllm serve` (http_guard.py) against slow, many and careless clients: stalled
headers are cut at --header-timeout, a stalled body is a 408 (requests over --limit-concurrency, and idle
connections: test_http_edge.py), a server at its open-file limit logs one line (not a traceback per accept)
and keeps serving, every error is OpenAI's JSON shape (lone surrogates, a bad tool_choice, bytes that are not
HTTP, unknown routes), /tokenize and /detokenize are guarded and bounded, and past --shutdown-timeout a SIGTERM
ends what still runs in OpenAI's shape (503, or an error event and [DONE] on a stream) and exits 0 leaving no
process behind."""
from __future__ import annotations

import json
import resource
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.utils import RemoteServer, with_context

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
C, CHAT = "/v1/completions", "/v1/chat/completions"
CAP = 8
LONG = {"prompt": "once upon a time", "max_tokens": 4000, "ignore_eos": True}
"""A request that runs for several seconds (on the long-context tiny model)."""


@pytest.fixture(scope="module")
def srv(tiny_llm_dir: Path) -> Iterator[RemoteServer]:
    s = RemoteServer(tiny_llm_dir, "--served-model-name", "tiny", "--max-model-len", "512", "--api-key", KEY,
                     "--header-timeout", "1", "--body-timeout", "1", "--limit-concurrency", str(CAP),
                     "--max-prompt-bytes", "1000")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def long_llm_dir(tiny_llm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a 4096-token context: requests that would run for many seconds."""
    return with_context(tiny_llm_dir, tmp_path_factory.mktemp("long-llm"), 4096)


def _openai_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    """The response is ``status`` with OpenAI's JSON error body (and the given param and code, if any)."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert param is None or error["param"] == param, error
    assert code is None or error["code"] == code, error
    return error


def _response(sock: socket.socket, timeout: float = 5.0) -> httpx.Response:
    """Read until the server closes the connection (socket.timeout if it does not within ``timeout``)."""
    sock.settimeout(timeout)
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = [tuple(x.strip() for x in line.split(":", 1)) for line in lines]
    return httpx.Response(int(status.split()[1]), headers=headers, content=body)


def _raw(port: int, data: bytes) -> httpx.Response:
    """The answer to ``data`` sent on a fresh connection."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(data)
        return _response(sock)


def _serves(srv: RemoteServer) -> None:
    r = httpx.post(f"{srv.url}{C}", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True}, headers=AUTH,
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def _serves_again(srv: RemoteServer, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{srv.url}/v1/models", headers=AUTH, timeout=2).status_code == 200:
                return _serves(srv)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"the server did not answer again within {within} s")


# ------------------------------------------------------------------------------------------- slow clients


def test_stalled_headers_are_cut_at_the_header_timeout_while_others_are_served(srv: RemoteServer) -> None:
    with socket.create_connection(("127.0.0.1", srv.port)) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        start = time.monotonic()
        _serves(srv)  # the stalled connection blocks nobody
        slow.settimeout(8)  # (the default --header-timeout is 10 s)
        try:
            assert slow.recv(1024) == b""  # closed without an answer: the request never began
        except ConnectionResetError:
            pass
        assert 0.5 < time.monotonic() - start < 6


def test_a_stalled_body_is_a_408_after_the_body_timeout_while_others_are_served(srv: RemoteServer) -> None:
    head = (f"POST {C} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
            "Content-Length: 100\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", srv.port)) as slow:
        slow.sendall(head + b'{"prompt": "a sl')
        start = time.monotonic()
        _serves(srv)
        r = _response(slow, timeout=8)  # (the default --body-timeout is 60 s)
        assert time.monotonic() - start < 6
    _openai_error(r, 408, code="body_timeout")
    assert r.headers["connection"] == "close"


# ------------------------------------------------------------------------------------------ many clients


def _stream(url: str, body: dict, events: list[tuple[float, str]], stop: threading.Event | None = None) -> None:
    """Collect a stream's data lines with their arrival times until it ends, is cut, or ``stop`` is set."""
    try:
        with httpx.stream("POST", f"{url}{C}", json={**body, "stream": True}, timeout=60) as r:
            events.append((time.monotonic(), f"status {r.status_code}"))
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append((time.monotonic(), line[6:]))
                if stop is not None and stop.is_set():
                    return
    except httpx.HTTPError as e:
        events.append((time.monotonic(), f"cut: {e!r}"))


def _lower_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))  # the hard limit too: the server raises soft to hard


def test_at_the_open_file_limit_the_server_logs_a_line_and_keeps_serving(long_llm_dir: Path,
                                                                        tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    s = RemoteServer(long_llm_dir, "--max-model-len", "4096", log=log, preexec_fn=_lower_fd_limit)
    try:
        events: list[tuple[float, str]] = []
        stop = threading.Event()
        admitted = threading.Thread(target=_stream, args=(s.url, LONG, events, stop), daemon=True)
        admitted.start()
        while len(events) < 3:  # admitted and streaming
            assert admitted.is_alive(), events
            time.sleep(0.05)
        size = log.stat().st_size
        flood = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(400)]  # > the server's 256 fds
        flooded = time.monotonic()
        time.sleep(3)
        for sock in flood:
            sock.close()
        over = time.monotonic()
        try:
            while not any(t > over for t, _ in events):  # the stream goes on after the flood too
                assert admitted.is_alive() and time.monotonic() < over + 20, events[-2:]
                time.sleep(0.05)
        finally:
            stop.set()
            admitted.join(10)
        assert events[0][1] == "status 200" and any(flooded + 1 < t < over for t, _ in events), "no tokens in the flood"
        assert not any(text.startswith(("{\"error\"", "cut", "[DONE]")) for _, text in events), events[-3:]
        _serves_again(s)
        assert s.proc.poll() is None
        grown = log.read_text(errors="replace")[size:]
        assert len(grown) < 100_000, len(grown)
        assert 1 <= grown.count("cannot accept new connections") <= 2, grown[-3000:]
        assert "out of system resource" not in grown, grown[-3000:]
    finally:
        s.stop()


# ------------------------------------------------------------------------------- every error in OpenAI's shape


@pytest.mark.parametrize("path, body, param", [
    (C, r'{"prompt": "a\ud800b", "max_tokens": 1}', "prompt"),
    (C, r'{"prompt": "hi", "max_tokens": 1, "stop": ["ok", "\ud800"]}', "stop[1]"),
    (C, r'{"prompt": "hi", "max_tokens": 1, "bad_words": ["\udfff"]}', "bad_words[0]"),
    (CHAT, r'{"messages": [{"role": "user", "content": "x\ud800"}], "max_tokens": 1}', "messages[0].content"),
    ("/tokenize", r'{"prompt": "\ud800"}', "prompt"),
])
def test_a_lone_surrogate_is_a_400_naming_its_field(srv: RemoteServer, path: str, body: str, param: str) -> None:
    r = httpx.post(f"{srv.url}{path}", content=body, headers={**AUTH, "content-type": "application/json"},
                   timeout=30)
    _openai_error(r, 400, param=param)
    _serves(srv)


def test_a_named_tool_choice_is_served_and_a_malformed_one_is_a_400(srv: RemoteServer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    named = {"type": "function", "function": {"name": "f"}}
    r = httpx.post(f"{srv.url}{CHAT}", json={**body, "tool_choice": named}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text  # the well-formed shape is served
    bad = {**body, "tool_choice": {**named, "function": "f"}}
    r = httpx.post(f"{srv.url}{CHAT}", json=bad, headers=AUTH, timeout=30)
    _openai_error(r, 400, param="tool_choice")


def test_bytes_that_are_not_http_and_unknown_routes_are_json(srv: RemoteServer) -> None:
    _openai_error(_raw(srv.port, b"\x16\x03\x01\x02\x00 not http at all\r\n\r\n"), 400)
    _openai_error(_raw(srv.port, b"GET / HTTP/1.1\r\nHost: x\r\nbad header line\r\n\r\n"), 400)
    _openai_error(httpx.get(f"{srv.url}/no/such/route", timeout=5), 404)
    _openai_error(httpx.post(f"{srv.url}/v1/no-such-endpoint", json={}, headers=AUTH, timeout=5), 404)


# ------------------------------------------------------------------------------------- /tokenize, /detokenize


def test_tokenize_and_detokenize_need_the_api_key(srv: RemoteServer) -> None:
    for path, body in (("/tokenize", {"prompt": "hello"}), ("/detokenize", {"tokens": [1, 2, 3]})):
        _openai_error(httpx.post(f"{srv.url}{path}", json=body, timeout=10), 401, code="invalid_api_key")
        bad = {"Authorization": "Bearer wrong"}
        _openai_error(httpx.post(f"{srv.url}{path}", json=body, headers=bad, timeout=10), 401)
        assert httpx.post(f"{srv.url}{path}", json=body, headers=AUTH, timeout=10).status_code == 200


def test_tokenize_and_detokenize_are_bounded(srv: RemoteServer) -> None:
    assert httpx.post(f"{srv.url}/tokenize", json={"prompt": "a" * 1000}, headers=AUTH, timeout=10).status_code == 200
    r = httpx.post(f"{srv.url}/tokenize", json={"prompt": "a" * 1001}, headers=AUTH, timeout=10)
    _openai_error(r, 400, param="prompt")
    r = httpx.post(f"{srv.url}/detokenize", json={"tokens": [5] * 513}, headers=AUTH, timeout=10)
    _openai_error(r, 400, param="tokens")
    assert httpx.post(f"{srv.url}/detokenize", json={"tokens": [5] * 512}, headers=AUTH, timeout=10).status_code == 200


# ------------------------------------------------------------------------------------------------ shutdown


def test_sigterm_past_the_shutdown_timeout_ends_requests_in_openai_shape(long_llm_dir: Path) -> None:
    s = RemoteServer(long_llm_dir, "--max-model-len", "2048", "--shutdown-timeout", "1")
    try:
        plain: list[httpx.Response] = []
        events: list[tuple[float, str]] = []
        body = {"prompt": ["once upon a time"] * 8, "max_tokens": 2000, "ignore_eos": True}  # many seconds

        def post() -> None:
            plain.append(httpx.post(f"{s.url}{C}", json=body, timeout=60))

        threads = [threading.Thread(target=post, daemon=True),
                   threading.Thread(target=_stream, args=(s.url, body, events), daemon=True)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(events) < 3 or s.metric("pagedllm:num_requests_running") < 16:  # both requests run
            assert time.monotonic() < deadline, events
            time.sleep(0.05)
        children = psutil.Process(s.proc.pid).children(recursive=True)
        sent = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=15) == 0
        assert time.monotonic() - sent < 6
        for t in threads:
            t.join(10)
        _openai_error(plain[0], 503, code="server_shutdown")
        assert [text for _, text in events[-1:]] == ["[DONE]"], events[-3:]
        error = json.loads(events[-2][1])["error"]
        assert error["code"] == "server_shutdown" and set(error) == {"message", "type", "param", "code"}, error
        _, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, alive
    finally:
        s.stop()
