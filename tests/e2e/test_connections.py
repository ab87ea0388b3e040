"""The connections a server keeps (our uvicorn set-up, served in-process on a loopback port,
with a small app): a request's head must arrive within --request-header-timeout (an idle or
slow-header connection is closed); at most --limit-concurrency connections (by default sized
from the file limit): a new one beyond it closes the connection that has waited longest for
a request's head, or is answered 503 when every connection has a request in progress. The
same against a real `vlmserve serve`: tests/e2e/test_server_hardening.py."""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from vlmserve.entrypoints.args import ServerConfig
from vlmserve.entrypoints.openai.connections import (
    RESERVED_FILES,
    connection_cap,
    server_config,
)
from vlmserve.entrypoints.openai.launch import _Server, bind_sockets


class App:
    """ASGI: `/hold` answers once `release` is set (counting the requests held), anything
    else at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.held = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == "/hold":
            self.held += 1
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


@contextlib.contextmanager
def guarded(app: App, **options) -> Iterator[int]:
    """``app`` behind our uvicorn set-up with these server options; yields the port."""
    sock = bind_sockets("127.0.0.1", 0)[0]
    server = _Server(server_config(app, ServerConfig(**options), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    port = sock.getsockname()[1]
    wait_for(lambda: server.started, "the server to start")
    try:
        yield port
    finally:
        app.release.set()
        server.should_exit = True
        thread.join(10)
        sock.close()


def wait_for(condition, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout  # bounds a broken test only
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return value


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def read_to_eof(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a test whose server never
    closes it fails at the socket's timeout); a reset, which a close with bytes of ours unread
    sends, ends it too."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(4096):
            data += chunk
    return data


def is_open(s: socket.socket) -> bool:
    """Nothing to read (not even the end): the server keeps the connection."""
    return not select.select([s], [], [], 0)[0]


def test_a_connection_past_the_cap_closes_the_one_idle_longest() -> None:
    app = App()
    with guarded(app, limit_concurrency=4, request_header_timeout=60) as port:
        idle = [connect(port) for _ in range(4)]
        extra = [connect(port) for _ in range(2)]
        assert read_to_eof(idle[0]) == b"" and read_to_eof(idle[1]) == b""
        r = httpx.get(f"http://127.0.0.1:{port}/ok", timeout=30)  # a normal request
        assert r.status_code == 200 and r.text == "ok"
        assert read_to_eof(idle[2]) == b""  # the oldest waiting made room for it
        assert all(is_open(s) for s in [idle[3], *extra])


def test_past_the_cap_with_every_connection_busy_a_new_one_gets_503() -> None:
    app = App()
    with guarded(app, limit_concurrency=2, request_header_timeout=60) as port:
        busy = [connect(port) for _ in range(2)]
        for s in busy:
            s.sendall(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
        wait_for(lambda: app.held == 2, "both requests to be held")
        late = connect(port)  # answered at once, before it sends anything
        assert read_to_eof(late).startswith(b"HTTP/1.1 503")
        app.release.set()
        for s in busy:
            assert s.recv(4096).startswith(b"HTTP/1.1 200")


def test_idle_and_slow_header_connections_are_closed_at_the_header_timeout() -> None:
    app = App()
    with guarded(app, request_header_timeout=1) as port:
        idle, slow = connect(port), connect(port)
        slow.sendall(b"GET /ok HTTP/1.1\r\n")
        deadline = time.monotonic() + 30  # bounds a broken test only
        while not select.select([slow], [], [], 0.1)[0]:  # a byte a tenth of a second
            assert time.monotonic() < deadline, "the slow header was never cut"
            slow.sendall(b"X")
        cut = read_to_eof(slow)  # a 408, unless a byte of ours crossed it (a reset)
        assert cut == b"" or cut.startswith(b"HTTP/1.1 408"), cut
        assert read_to_eof(idle) == b""
        # after a response, the next request's head is timed too (a kept-alive connection)
        kept = connect(port)
        kept.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        assert kept.recv(4096).startswith(b"HTTP/1.1 200")
        kept.sendall(b"GET /ok HTTP/1.1\r\n")
        assert read_to_eof(kept).startswith(b"HTTP/1.1 408")


def test_a_request_head_over_64_kib_is_a_431() -> None:
    app = App()
    with guarded(app, request_header_timeout=60) as port:
        s = connect(port)
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            s.sendall(b"GET /ok HTTP/1.1\r\n" + b"X-Pad: " + b"a" * (80 << 10) + b"\r\n")
        refused = read_to_eof(s)  # a 431, unless the rest of ours was reset
        assert refused == b"" or refused.startswith(b"HTTP/1.1 431"), refused


@pytest.mark.parametrize("soft, cap", [(1024, 1024 - RESERVED_FILES), (300, 150),
                                       (65536, 65536 - RESERVED_FILES)])
def test_the_default_cap_is_sized_from_the_file_limit(soft: int, cap: int) -> None:
    assert connection_cap(ServerConfig(), soft) == cap
    assert connection_cap(ServerConfig(limit_concurrency=10), soft) == 10
