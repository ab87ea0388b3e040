"""The connections an HTTP front end keeps (both servers'), bounded: a request's head must
arrive within `--request-header-timeout` seconds of the connection opening or of its last
response (else the connection is closed: a 408 if the head had begun), and may not pass
`MAX_HEAD_BYTES` (a 431); at most `--limit-concurrency` connections are open (by default the
process's file limit less what the server needs for its own files): one beyond it closes the
connection that has waited longest for a request's head, or, when every connection has a
request in progress, is answered 503 and closed. Idle connections after a response are
closed after `--timeout-keep-alive` seconds (uvicorn's own timer).

uvicorn has neither a header timeout nor a cap on connections (its `limit_concurrency`
answers 503 to requests but keeps every connection, and with it a file), so its HTTP
protocol class is subclassed: `guarded_protocol`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import resource
from typing import Any

import uvicorn
from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

from vlmserve.entrypoints.args import ServerConfig

logger = logging.getLogger(__name__)
RESERVED_FILES = 256  # files a front end keeps for itself (sockets to the core, pipes, logs)
FILE_LIMIT = 65536  # the file limit a server raises its own to, where the hard limit allows
MAX_HEAD_BYTES = 64 << 10  # a request's line and headers

_REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\n"
                    b"content-length: 0\r\n\r\n")
_HEAD_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\n"
                   b"content-length: 0\r\n\r\n")
_BUSY_BODY = b'{"error": {"message": "too many connections", "type": "server_error"}}'
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\ncontent-type: "
         b"application/json\r\ncontent-length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n"
         + _BUSY_BODY)


def raise_file_limit() -> int:
    """This process's soft file limit raised to its hard limit, up to `FILE_LIMIT` (as vLLM
    does; children inherit it); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = FILE_LIMIT if hard == resource.RLIM_INFINITY else min(hard, FILE_LIMIT)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def connection_cap(cfg: ServerConfig, soft_limit: int | None = None) -> int:
    """The most connections a front end keeps open: `--limit-concurrency`, else its file
    limit less the files it needs itself (`RESERVED_FILES`, at most half)."""
    if cfg.limit_concurrency is not None:
        return cfg.limit_concurrency
    if soft_limit is None:
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft_limit == resource.RLIM_INFINITY:
        soft_limit = FILE_LIMIT
    return max(soft_limit - min(RESERVED_FILES, soft_limit // 2), 1)


class _Guard:
    """One server's bounds and its connections waiting for a request's head, oldest first."""

    def __init__(self, cap: int, header_timeout: float) -> None:
        self.cap, self.header_timeout = cap, header_timeout
        self.waiting: collections.OrderedDict[Any, None] = collections.OrderedDict()


def guarded_protocol(base: type[asyncio.Protocol], guard: _Guard) -> type[asyncio.Protocol]:
    """``base`` (one of uvicorn's HTTP/1.1 protocols: they share `cycle`, `connections`,
    `transport`, `loop` and `on_response_complete`) with ``guard``'s bounds."""

    class Guarded(base):  # type: ignore[valid-type, misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_timer: asyncio.TimerHandle | None = None
            self._head_cycle: Any = None  # the cycle when it began waiting (None: new)
            self._head_bytes = 0
            self._waiting = False

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()
            if len(self.connections) > guard.cap:
                victim = next((c for c in guard.waiting if c is not self), None)
                if victim is not None:  # the one idle longest makes room
                    victim._close(_BUSY if victim._head_bytes else None)
                else:  # every other one has a request in progress
                    self._close(_BUSY)

        def data_received(self, data: bytes) -> None:
            waiting = self._waiting
            super().data_received(data)
            if not waiting or not self._waiting:
                return
            if self.cycle is not self._head_cycle:  # the head arrived: a request began
                self._disarm()
                return
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._close(_HEAD_TOO_LARGE)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (
                    self.cycle is None or self.cycle.response_complete):
                self._arm()  # kept alive: the next request's head is timed too

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_cycle, self._head_bytes, self._waiting = self.cycle, 0, True
            guard.waiting[self] = None
            self._head_timer = self.loop.call_later(guard.header_timeout, self._timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            if self._waiting:
                self._waiting = False
                guard.waiting.pop(self, None)

        def _timed_out(self) -> None:
            self._head_timer = None
            if self._waiting and self.cycle is self._head_cycle:
                self._close(_REQUEST_TIMEOUT if self._head_bytes else None)

        def _close(self, response: bytes | None) -> None:
            self._disarm()
            if not self.transport.is_closing():
                if response is not None:
                    self.transport.write(response)
                self.transport.close()
            self.connections.discard(self)  # no longer counted against the cap

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


def server_config(app: Any, cfg: ServerConfig, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's configuration of a front end serving ``app`` under ``cfg``'s connection
    bounds (its log level, --uvicorn-log-level else --log-level, and its access log, off with
    --disable-log-requests, unless ``kwargs`` give them)."""
    guard = _Guard(connection_cap(cfg), cfg.request_header_timeout)
    base = import_from_string(HTTP_PROTOCOLS["auto"])
    kwargs.setdefault("log_level", cfg.uvicorn_log_level or cfg.log_level)
    kwargs.setdefault("access_log", not cfg.disable_log_requests)
    return uvicorn.Config(app, http=guarded_protocol(base, guard),
                          timeout_keep_alive=cfg.timeout_keep_alive, **kwargs)
