"""The consumer's lifetime ledger of embedding handles (`ConsumerLedger`, one per process:
`consumer_ledger()`): refuses a second open of a handle id in this process, tells each handle's
producer (its `HandleLedger`, ledger.py) that it was opened and released, counts what was
opened, copied and released."""

from __future__ import annotations

import atexit
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing import util as mp_util
from typing import TYPE_CHECKING

from vlmserve.transfer.handles import EmbeddingHandle, HandleOpenedTwiceError

if TYPE_CHECKING:
    import zmq

_REMEMBER_IDS = 1 << 16  # ids kept after they are freed, to tell a late open from a stray one


@dataclass
class ConsumerStats:
    opened: int = 0
    released: int = 0  # releases sent: after an open, or of a handle given up unread
    discarded: int = 0  # given up unread (`EmbeddingHandle.release`)
    refused: int = 0  # second opens refused in this process
    failed: int = 0  # opens whose read failed (expired, segment gone)
    copied_bytes: int = 0
    live: int = 0  # opened, not released yet (a copy in progress)


class ConsumerLedger:
    """The consumer's side: one PUSH socket per producer address, the handle ids this
    process has opened or released (the latest ``remember`` of them), counters.
    Thread-safe."""

    def __init__(self, remember: int = _REMEMBER_IDS, linger_ms: int = 2000) -> None:
        self.pid = os.getpid()
        self._remember, self._linger_ms = remember, linger_ms
        self._lock = threading.Lock()
        self._ctx: zmq.Context | None = None
        self._sockets: dict[str, zmq.Socket] = {}
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._live: set[str] = set()
        self._stats = ConsumerStats()
        self.dropped_messages = 0  # a producer that is gone or not reading

    def begin(self, handle: EmbeddingHandle) -> None:
        """Before reading ``handle``: refuse a second open, tell the producer."""
        with self._lock:
            self._claim(handle)
            self._live.add(handle.handle_id)
            self._stats.opened += 1
            self._send(handle, "opened")

    def finish(self, handle: EmbeddingHandle, copied: bool) -> None:
        """After reading ``handle`` (``copied``: successfully): release it."""
        with self._lock:
            self._live.discard(handle.handle_id)
            self._stats.released += 1
            if copied:
                self._stats.copied_bytes += handle.nbytes
            else:
                self._stats.failed += 1
            self._send(handle, "released")

    def discard(self, handle: EmbeddingHandle) -> None:
        """Release ``handle`` unread."""
        with self._lock:
            self._claim(handle)
            self._stats.released += 1
            self._stats.discarded += 1
            self._send(handle, "released")

    def _claim(self, handle: EmbeddingHandle) -> None:
        if handle.handle_id in self._seen:
            self._stats.refused += 1
            raise HandleOpenedTwiceError(f"handle {handle.handle_id} was already opened or "
                                         "released in this process")
        self._seen[handle.handle_id] = None
        if len(self._seen) > self._remember:
            self._seen.popitem(last=False)

    def _send(self, handle: EmbeddingHandle, event: str) -> None:
        address = handle.release_address
        if address is None:
            return
        import zmq  # here: an engine that never opens a handle runs without pyzmq (offline)

        sock = self._sockets.get(address)
        if sock is None:
            if self._ctx is None:
                self._ctx = zmq.Context()
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, self._linger_ms)
            sock.connect(address)
            self._sockets[address] = sock
        try:  # never block on a producer that is gone: its lease reclaims instead
            sock.send(f"{event} {handle.handle_id} {self.pid}".encode(), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped_messages += 1

    def stats(self) -> ConsumerStats:
        with self._lock:
            return ConsumerStats(**{**vars(self._stats), "live": len(self._live)})

    def close(self) -> None:
        """Flush the messages (up to the linger time) and close the sockets."""
        with self._lock:
            for sock in self._sockets.values():
                sock.close()
            self._sockets.clear()
            if self._ctx is not None:
                self._ctx.term()
                self._ctx = None


_consumer: ConsumerLedger | None = None
_consumer_lock = threading.Lock()


def consumer_ledger() -> ConsumerLedger:
    """This process's consumer ledger (a new one after a fork)."""
    global _consumer
    with _consumer_lock:
        if _consumer is None or _consumer.pid != os.getpid():
            _consumer = ConsumerLedger()
            # flushed at exit: atexit for the main process, multiprocessing's finalizers for
            # its children (which leave through os._exit after a fork)
            atexit.register(_consumer.close)
            mp_util.Finalize(None, _consumer.close, exitpriority=10)
        return _consumer
