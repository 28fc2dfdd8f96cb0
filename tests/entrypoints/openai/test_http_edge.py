"""Idle connections are not requests (issue 43, point 1), against a real `pagedllm serve`: thousands of sockets
that never send a byte leave --limit-concurrency to the requests in flight, a burst over the cap is refused
exactly its excess, and one client address cannot hold more than --max-connections-per-client connections
(those over it are closed at once, one log line) while other addresses are served."""
from __future__ import annotations

import resource
import selectors
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.utils import RemoteServer

C = "/v1/completions"
CAP = 16
"""--limit-concurrency of the server here: far below the idle sockets."""


def _raise_own_fd_limit() -> int:
    """This process's soft open-file limit raised to the hard one; the number of sockets a test may open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


IDLE = min(4100, (_raise_own_fd_limit() - 300) // 2)
"""Idle sockets: the issue's 4,100 where the open-file limit allows (both ends in one machine), else fewer;
always far over CAP."""
PER_CLIENT = IDLE + 50
"""--max-connections-per-client: room for the idle sockets of one address, and 100 more are over it."""


@pytest.fixture(scope="module")
def edge(tiny_llm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RemoteServer, Path]]:
    log = tmp_path_factory.mktemp("edge") / "server.log"
    s = RemoteServer(tiny_llm_dir, "--served-model-name", "tiny", "--max-model-len", "512",
                     "--limit-concurrency", str(CAP), "--max-connections-per-client", str(PER_CLIENT),
                     "--header-timeout", "30", "--body-timeout", "20", log=log)
    yield s, log
    s.stop()


def _serves(srv: RemoteServer) -> None:
    r = httpx.post(f"{srv.url}{C}", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def _server_connections(srv: RemoteServer, client_ip: str) -> int:
    """The server's established TCP connections from ``client_ip``."""
    return sum(1 for c in psutil.Process(srv.proc.pid).net_connections(kind="tcp")
               if c.raddr and c.raddr.ip == client_ip and c.status == psutil.CONN_ESTABLISHED)


def _wait_for_connections(srv: RemoteServer, client_ip: str, n: int, within: float = 30.0) -> None:
    """Until the server has accepted ``n`` connections from ``client_ip`` (not left in the listen backlog)."""
    deadline = time.monotonic() + within
    while (held := _server_connections(srv, client_ip)) < n:
        assert time.monotonic() < deadline, f"the server accepted {held} of {n} connections"
        time.sleep(0.2)


def _open(port: int, n: int, source: str) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), source_address=(source, 0)) for _ in range(n)]


def _closed_by_server(socks: list[socket.socket], quiet: float = 2.0, within: float = 20.0) -> list[socket.socket]:
    """The sockets the server closes (EOF or reset), collected until none closes for ``quiet`` seconds."""
    closed: list[socket.socket] = []
    with selectors.DefaultSelector() as sel:  # epoll: select() takes no fd over 1023
        for s in socks:
            sel.register(s, selectors.EVENT_READ)
        deadline, last = time.monotonic() + within, time.monotonic()
        while len(closed) < len(socks) and time.monotonic() < deadline and time.monotonic() - last < quiet:
            for key, _ in sel.select(0.1):
                try:
                    data = key.fileobj.recv(4096)
                except ConnectionResetError:
                    data = b""
                if not data:
                    sel.unregister(key.fileobj)
                    closed.append(key.fileobj)
                    last = time.monotonic()
    return closed


def test_thousands_of_idle_connections_are_not_requests(edge: tuple[RemoteServer, Path]) -> None:
    srv, _ = edge
    idle = _open(srv.port, IDLE, "127.0.0.1")  # never a byte: the issue's attack, at the same address
    try:
        _wait_for_connections(srv, "127.0.0.1", IDLE)  # all accepted: each one a connection of the server
        _serves(srv)  # (over CAP connections: before, a 503 too_many_connections)
        assert httpx.get(f"{srv.url}/v1/models", timeout=10).status_code == 200
    finally:
        for s in idle:
            s.close()


def test_a_burst_over_the_cap_refuses_exactly_its_excess(edge: tuple[RemoteServer, Path]) -> None:
    srv, _ = edge
    extra = 5
    body = b'{"prompt": "hi", "max_tokens": 1}'
    head = (f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    burst = _open(srv.port, CAP + extra, "127.0.0.1")
    try:
        for s in burst:  # headers and half a body: each admitted request is held in flight (--body-timeout 20)
            s.sendall(head + body[:10])
        refused = _closed_by_server(burst)  # a refusal is a whole 503 and a close; a held request says nothing
        assert len(refused) == extra, f"{len(refused)} refused of a burst of {CAP + extra} at a cap of {CAP}"
        held = [s for s in burst if s not in refused]
        for s in held:
            s.sendall(body[10:])
        for s in held:
            s.settimeout(30)
            assert s.recv(65536).startswith(b"HTTP/1.1 200"), "an admitted request was not served"
    finally:
        for s in burst:
            s.close()
    r = _refusal(srv.port, CAP)
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    error = r.json()["error"]
    assert error["code"] == "too_many_connections" and set(error) == {"message", "type", "param", "code"}, error
    _serves(srv)  # every slot given back


def _refusal(port: int, cap: int) -> httpx.Response:
    """The answer to one request while ``cap`` requests are held in flight (their bodies stalled)."""
    held = _open(port, cap, "127.0.0.1")
    try:
        for s in held:
            s.sendall(f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{{".encode())
        time.sleep(0.5)  # (their headers reach the server first)
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{{}}".encode())
            s.settimeout(10)
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
    finally:
        for s in held:
            s.close()
    head, _, content = raw.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    return httpx.Response(int(status.split()[1]), headers=[tuple(x.strip() for x in line.split(":", 1))
                                                            for line in lines], content=content)


def test_one_address_cannot_hold_more_than_its_connections(edge: tuple[RemoteServer, Path]) -> None:
    srv, log = edge
    size = log.stat().st_size
    crowd = _open(srv.port, PER_CLIENT + 100, "127.0.0.2")  # another address of this machine (127/8 is local)
    try:
        _wait_for_connections(srv, "127.0.0.2", PER_CLIENT)
        closed = _closed_by_server(crowd)
        assert len(closed) == 100, f"{len(closed)} closed of {PER_CLIENT + 100} over a cap of {PER_CLIENT}"
        assert _server_connections(srv, "127.0.0.2") == PER_CLIENT
        _serves(srv)  # another address is served
    finally:
        for s in crowd:
            s.close()
    grown = log.read_text(errors="replace")[size:]
    assert grown.count("--max-connections-per-client") == 1, grown[-2000:]  # one line a minute, not 100
