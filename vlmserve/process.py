"""The skeleton the engine core (engine/core_proc.py) and the encoder core (encoder/service.py)
share: `start_core` spawns a core by the name of its entry (its starter loads none of its
modules), `run_core` is that entry's life (dies with its parent, signals, logging, the ROUTER
socket and the loop that checks the parent while idle), `WATCH_S` paces the clients' checks
that their core lives.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import zmq

from vlmserve.utils import (
    IDLE_POLL_MS,
    die_with_parent,
    limit_host_threads,
    resolve_device,
    run_by_name,
    start_children,
)

logger = logging.getLogger(__name__)
WATCH_S = 0.2  # how often a client checks that its core process lives


@dataclass(frozen=True)
class CoreHandle:
    """Where a core process listens, and its pid (to notice its death)."""

    address: str
    pid: int


def start_core(target: str, name: str, *args: Any) -> tuple[mp.process.BaseProcess, CoreHandle]:
    """Spawn process ``name`` running ``target(address, parent_pid, *args)`` (``target``:
    "package.module:function"); it dies with this process."""
    address = f"ipc://{tempfile.gettempdir()}/{name}-{uuid.uuid4().hex[:12]}"
    proc = mp.get_context("spawn").Process(
        target=run_by_name, name=name, args=(target, address, os.getpid(), *args), daemon=False)
    start_children(proc.start)
    return proc, CoreHandle(address, proc.pid)


def run_core(build: Callable[[zmq.Socket], Any], address: str, parent_pid: int, name: str,
             device: str, log_level: str = "info", ready: Connection | None = None) -> None:
    """A core process's life. It dies with its parent (PR_SET_PDEATHSIG; and a check of the
    parent's pid every `IDLE_POLL_MS` while idle, PR_SET_PDEATHSIG being Linux's), keeps one
    intra-op thread when ``device`` (the configured one) is a GPU, ignores SIGINT (Ctrl-C
    reaches the front end, which stops it) and exits cleanly on SIGTERM. ``build(sock)``
    makes the core around its ROUTER socket, bound at ``address``: ``step()`` handles the
    waiting messages and the work they bring, ``busy()`` says there is work without a
    message, ``stopping`` ends the loop, ``close()`` follows the socket's. With ``ready``,
    ("ready", pid) or ("error", why) is sent there once the core is built or has failed."""
    die_with_parent()
    if resolve_device(device).type == "cuda":
        limit_host_threads()
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    core = None
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a slow front end
        sock.bind(address)
        core = build(sock)
        if ready is not None:
            ready.send(("ready", os.getpid()))
        while not core.stopping:
            if not core.busy() and not sock.poll(IDLE_POLL_MS):
                if os.getppid() != parent_pid:
                    logger.error("the server process is gone; the %s exits", name)
                    return
                continue
            core.step()
    except SystemExit:
        pass
    except BaseException as e:
        logger.exception("the %s failed", name)
        if ready is not None:
            with contextlib.suppress(OSError):
                ready.send(("error", f"{type(e).__name__}: {e}"))
        raise
    finally:
        sock.close(0)
        ctx.term()
        if core is not None:
            core.close()


def _exit(*_: Any) -> None:
    raise SystemExit(0)
