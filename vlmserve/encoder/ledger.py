"""The producer's lifetime ledger of embedding handles (`HandleLedger`): every exported
handle is recorded (exported, opened, released times) until its backing storage is freed,
which happens exactly once: when the consumer releases it, or when its lease runs out (a
consumer that died or never came), or at `close`. Consumers report on a zmq PULL socket
(``ipc://`` or ``tcp://``) with one-line messages ``"opened <handle_id> <pid>"`` and
``"released <handle_id> <pid>"``, read by a background thread (or by `poll` in the
producer's own loop). A handle opened twice is recorded.

`on_free` tells the producer each handle's fate (the encoder server learns from it which images
a consumer holds: delivered.py). The consumer's side, which sends those messages, is
consumer_ledger.py.

A producer killed outright (SIGKILL, the OOM killer) cannot free what it held: its
shared-memory segments and its socket file stay behind. Each new ledger removes those of
producers that are no longer alive (`reap_orphans`: the process id is in each name), so a
restarted encoder does not leave /dev/shm filling up.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import secrets
import tempfile
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from vlmserve.transfer.cuda_pool import CudaPool, PooledBacking, make_cuda_pooled
from vlmserve.transfer.handles import EmbeddingHandle, make_bytes, make_cuda, make_shm

TRANSPORTS = ("auto", "shm", "cuda", "bytes")
_SHM_DIR = "/dev/shm"
# a ledger's segment (`segment_prefix`) and socket file (the default address): its token starts
# with its producer's process id
_SEGMENT = re.compile(r"vlms-(\d+)x[0-9a-f]{6}-\d+")
_SOCKET = re.compile(r"vlmserve-ledger-(\d+)x[0-9a-f]{6}\.sock")
logger = logging.getLogger(__name__)
_REMEMBER_IDS = 1 << 16  # ids kept after they are freed, to tell a late open from a stray one


@dataclass
class HandleRecord:
    handle_id: str
    kind: str  # shm, cuda, bytes
    nbytes: int
    held_bytes: int  # what the producer keeps for it (0 for bytes handles)
    exported_at: float  # time.monotonic()
    deadline: float  # time.monotonic() at which the lease runs out
    backing: Any
    opened_at: float | None = None
    released_at: float | None = None
    consumer_pid: int | None = None
    opens: int = 0


@dataclass
class LedgerStats:
    live_handles: int = 0  # exported, not freed yet
    live_bytes: int = 0  # bytes the producer holds for them (shared memory, GPU blocks)
    exported: int = 0
    exported_bytes: int = 0
    opened: int = 0
    released: int = 0  # freed on the consumer's release
    reclaimed: int = 0  # freed at the lease (or at close) without a release
    double_opens: int = 0  # opens of a handle already opened or released
    late_opens: int = 0  # opens of a handle already reclaimed (past its lease)
    late_releases: int = 0  # releases of handles already reclaimed
    unknown_messages: int = 0
    free_errors: int = 0
    cuda_pool_bytes: int = 0  # pooled CUDA memory reserved for handles (live or free slots)


def _pid_alive(pid: int | None) -> bool:
    """Whether process ``pid`` (on this host) still runs; a zombie counts as dead."""
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class HandleLedger:
    """The producer's ledger. ``export(rows)`` makes a handle and records it.

    Args:
        address: zmq endpoint to bind for release messages; default a fresh ``ipc://``
            socket in the temp folder (``tcp://host:*`` picks a free port).
        lease_s: a handle not released this long after its export (or after its open) is
            reclaimed; the handle's ``expires_at`` tells the consumer when it may no longer
            open it, and the producer waits ``grace_s`` more before reclaiming.
        background: read messages and reclaim on a thread of the ledger's own; if False,
            the producer calls `poll` in its loop.
        advertise: the address written into handles, if not the bound one (e.g. this
            host's name for ``tcp://0.0.0.0:*``).
        cuda_pool: CUDA handles are slots of a pool shared once per block (`CudaPool`: a
            consumer maps each block once; released slots are reused); False exports each
            handle as an IPC allocation of its own (a mapping per open, ~1 ms).
        on_free: ``on_free(handle_id, delivered)`` after each handle is freed (on the
            ledger's thread); ``delivered``: its consumer opened and released it.
    """

    def __init__(self, address: str | None = None, lease_s: float = 30.0,
                 grace_s: float = 0.5, background: bool = True,
                 advertise: str | None = None, poll_interval_s: float = 0.05,
                 cuda_pool: bool = True,
                 on_free: Callable[[str, bool], None] | None = None) -> None:
        if lease_s <= 0:
            raise ValueError("lease_s must be > 0")
        self.token = f"{os.getpid()}x{secrets.token_hex(3)}"
        reap_orphans()
        self.lease_s, self.grace_s = lease_s, grace_s
        self.poll_interval_s = poll_interval_s
        if address is None:
            address = f"ipc://{tempfile.gettempdir()}/vlmserve-ledger-{self.token}.sock"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._ipc_path = address[len("ipc://"):] if address.startswith("ipc://") else None
        bound = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.address = advertise or bound
        self._ids = itertools.count()
        self._cuda_pool = cuda_pool
        self._on_free = on_free
        self._pools: dict[torch.device, CudaPool] = {}
        self._lock = threading.Lock()
        self._live: dict[str, HandleRecord] = {}
        self._freed: OrderedDict[str, str] = OrderedDict()  # id -> "released" / "reclaimed"
        self._stats = LedgerStats()
        self.errors: deque[str] = deque(maxlen=256)  # recent contract violations
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="handle-ledger",
                                            daemon=True)
            self._thread.start()

    # ---- export ----------------------------------------------------------------------------

    def segment_prefix(self) -> str:
        """Names of this ledger's shared-memory segments start with this."""
        return f"vlms-{self.token}-"

    def export(self, rows: torch.Tensor, transport: str = "auto") -> EmbeddingHandle:
        """A handle to a copy of ``rows`` ([num_rows, hidden]), recorded as live.

        ``transport``: ``auto`` (CUDA IPC for CUDA tensors, else shared memory), ``shm``,
        ``cuda`` or ``bytes``."""
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {transport!r}; choose from {TRANSPORTS}")
        if self._closed:
            raise RuntimeError("the ledger is closed")
        if transport == "auto":
            transport = "cuda" if rows.is_cuda else "shm"
        handle_id = f"{self.token}-{next(self._ids)}"
        expires_at = time.time() + self.lease_s
        exported_at = time.monotonic()
        if transport == "shm":
            handle, backing = make_shm(rows, handle_id, self.address, expires_at,
                                       segment=f"vlms-{handle_id}")
        elif transport == "cuda" and self._cuda_pool:
            with self._lock:
                pool = self._pools.get(rows.device)
                if pool is None:
                    pool = self._pools[rows.device] = CudaPool(rows.device)
            handle, backing = make_cuda_pooled(rows, pool, handle_id, self.address, expires_at)
        elif transport == "cuda":
            handle, backing = make_cuda(rows, handle_id, self.address, expires_at)
        else:
            handle, backing = make_bytes(rows, handle_id, self.address, expires_at)
        held = (0 if transport == "bytes" else backing.slot[2]
                if isinstance(backing, PooledBacking) else handle.nbytes)
        rec = HandleRecord(handle_id, transport, handle.nbytes, held, exported_at,
                           exported_at + self.lease_s, backing)
        with self._lock:
            self._live[handle_id] = rec
            s = self._stats
            s.exported += 1
            s.exported_bytes += handle.nbytes
            s.live_handles += 1
            s.live_bytes += held
        return handle

    # ---- messages and leases ---------------------------------------------------------------

    def poll(self, timeout_s: float = 0.0) -> int:
        """Read the release messages that arrived (waiting up to ``timeout_s`` for the first)
        and reclaim expired handles; returns the messages read. Only without a background
        thread."""
        if self._thread is not None:
            raise RuntimeError("this ledger polls on its own thread")
        return self._poll(timeout_s)

    def _poll(self, timeout_s: float) -> int:
        n = 0
        if self._sock.poll(int(timeout_s * 1000)):
            while True:
                try:
                    msg = self._sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    self._on_message(msg)
                except Exception as e:  # the thread must outlive a bad message
                    with self._lock:
                        self._stats.unknown_messages += 1
                        self.errors.append(f"message {msg[:80]!r}: {e!r}")
                n += 1
        self.reclaim_expired()
        return n

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._poll(self.poll_interval_s)
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise

    def _on_message(self, msg: bytes) -> None:
        try:
            event, handle_id, pid = msg.decode().split()
            pid_n = int(pid)
        except ValueError:
            with self._lock:
                self._stats.unknown_messages += 1
            return
        now = time.monotonic()
        free = None
        with self._lock:
            s = self._stats
            rec = self._live.get(handle_id)
            if event == "opened":
                if rec is None:
                    fate = self._freed.get(handle_id)
                    if fate is not None:
                        if fate == "released":
                            s.double_opens += 1
                        else:
                            s.late_opens += 1
                        self.errors.append(f"handle {handle_id} opened after it was {fate} "
                                           f"(pid {pid_n})")
                    else:
                        s.unknown_messages += 1
                    return
                rec.opens += 1
                if rec.opens > 1:
                    s.double_opens += 1
                    self.errors.append(f"handle {handle_id} opened {rec.opens} times "
                                       f"(pid {rec.consumer_pid}, then {pid_n})")
                    return
                s.opened += 1
                rec.opened_at, rec.consumer_pid = now, pid_n
                rec.deadline = max(rec.deadline, now + self.lease_s)  # time to copy
            elif event == "released":
                if rec is None:
                    if self._freed.get(handle_id) == "reclaimed":
                        s.late_releases += 1
                    else:
                        s.unknown_messages += 1
                    return
                rec.released_at = now
                s.released += 1
                free = self._forget(rec, "released")
            else:
                s.unknown_messages += 1
                return
        if free is not None:
            self._free(free, opened=free.opens > 0, consumer_alive=True)

    def reclaim_expired(self, now: float | None = None) -> int:
        """Free every handle whose lease (plus the grace) ran out; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [r for r in self._live.values() if now > r.deadline + self.grace_s]
            for rec in expired:
                self._forget(rec, "reclaimed")
                self._stats.reclaimed += 1
        for rec in expired:
            self._free(rec, opened=rec.opens > 0, consumer_alive=_pid_alive(rec.consumer_pid))
        return len(expired)

    def _forget(self, rec: HandleRecord, fate: str) -> HandleRecord:
        """Move ``rec`` out of the live table (under the lock)."""
        del self._live[rec.handle_id]
        self._freed[rec.handle_id] = fate
        if len(self._freed) > _REMEMBER_IDS:
            self._freed.popitem(last=False)
        return rec

    def _free(self, rec: HandleRecord, *, opened: bool, consumer_alive: bool) -> None:
        """Free the backing of a forgotten record; it stops counting as live only after (so
        whoever sees ``live_handles == 0`` finds every segment unlinked)."""
        error = None
        try:
            rec.backing.free(opened=opened, consumer_alive=consumer_alive)
        except Exception as e:  # a ledger that stops freeing would leak everything after
            error = e
        with self._lock:
            self._stats.live_handles -= 1
            self._stats.live_bytes -= rec.held_bytes
            if error is not None:
                self._stats.free_errors += 1
                self.errors.append(f"handle {rec.handle_id}: freeing failed: {error!r}")
        if self._on_free is not None:
            self._on_free(rec.handle_id, rec.released_at is not None and rec.opens > 0)

    # ---- state -----------------------------------------------------------------------------

    def stats(self) -> LedgerStats:
        with self._lock:
            pooled = sum(p.reserved_bytes for p in self._pools.values())
            return LedgerStats(**{**vars(self._stats), "cuda_pool_bytes": pooled})

    def record(self, handle_id: str) -> HandleRecord | None:
        """The live record of a handle (None once freed)."""
        with self._lock:
            return self._live.get(handle_id)

    def close(self) -> None:
        """Stop reading, read what arrived, reclaim every live handle, close the socket."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._poll(0.0)
        self.reclaim_expired(now=float("inf"))
        for pool in self._pools.values():
            pool.close()
        self._sock.close(linger=0)
        self._ctx.term()
        if self._ipc_path is not None:  # libzmq leaves the socket file behind
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._ipc_path)

    def __enter__(self) -> HandleLedger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def reap_orphans(shm_dir: str = _SHM_DIR, socket_dir: str | None = None) -> int:
    """Remove the shared-memory segments and ledger socket files of producers that are no
    longer alive (their process id, in each name, names no process); returns how many. A
    consumer that mapped such a segment keeps its mapping; one that had not yet opened it
    gets the error of a segment gone (its producer's handles died with it)."""
    removed = 0
    for folder, pattern in ((shm_dir, _SEGMENT), (socket_dir or tempfile.gettempdir(),
                                                  _SOCKET)):
        try:
            names = os.listdir(folder)
        except OSError:  # no /dev/shm here
            continue
        for name in names:
            m = pattern.fullmatch(name)
            if m is None or _alive(int(m.group(1))):
                continue
            with contextlib.suppress(FileNotFoundError):  # (another ledger reaped it first)
                os.unlink(os.path.join(folder, name))
                removed += 1
    if removed:
        logger.info("removed %d shared-memory segments and socket files of encoders that "
                    "are gone", removed)
    return removed
