"""Ranks 1..N-1 of a tensor-parallel group spawned on this host for rank 0 (the engine's
executor, a tensor-parallel encoder): their processes, the store they meet at (on 127.0.0.1
alone), their liveness and the errors they report, and their stop.

Each follower joins the group, then runs its user's loop (``target(tp, *args)``) until rank 0
says stop. One that raises writes its error in the store before it exits, so rank 0's
`RankFailedError` names the rank, its exit code and its error, whichever collective found it.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vlmserve.distributed.parallel_state import RankFailedError, TensorParallel, join_group
from vlmserve.utils import limit_host_threads, resolve_device, start_children

logger = logging.getLogger(__name__)


class Followers:
    """Rank 0's view of ranks 1..N-1. The constructor spawns them (they load while rank 0
    does); `connect` joins rank 0 to their group."""

    def __init__(self, world: int, target: Callable[..., None], args: tuple, device: str,
                 timeout_s: float, start_timeout_s: float = 300.0,
                 name: str = "vlmserve-tp") -> None:
        self.world_size = world
        self.timeout_s = timeout_s
        self.start_timeout_s = max(start_timeout_s, timeout_s)
        listener = socket.create_server(("127.0.0.1", 0))  # the store's, on loopback alone
        port = listener.getsockname()[1]
        self.store: Any = dist.TCPStore(
            "127.0.0.1", port, world, True, timedelta(seconds=self.start_timeout_s),
            wait_for_workers=False, master_listen_fd=listener.detach())
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=follower_main, daemon=True, name=f"{name}{rank}",
                                  args=(target, args, rank, world, port, device, timeout_s,
                                        self.start_timeout_s))
                      for rank in range(1, world)]
        start_children(lambda: [p.start() for p in self.procs])
        self.tp: TensorParallel | None = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def connect(self, device: torch.device) -> TensorParallel:
        """Join the group as rank 0 once every follower is at it (within the start timeout;
        one that exits first is reported at once, with its error)."""
        keys = [f"joining/{r}" for r in range(1, self.world_size)]
        deadline = time.monotonic() + self.start_timeout_s
        while not self.store.check(keys):
            if dead := self.dead():
                raise RankFailedError(f"a tensor-parallel rank failed to start "
                                      f"({'; '.join(dead)})")
            if time.monotonic() > deadline:
                raise RankFailedError(f"tensor-parallel ranks not started within "
                                      f"{self.start_timeout_s:g} s")
            time.sleep(0.02)
        self.tp = join_group(0, self.world_size, self.store, device, self.timeout_s,
                             self.start_timeout_s, loopback=True)
        self.tp.followers = self
        return self.tp

    def dead(self, wait_s: float = 0.0) -> list[str]:
        """Each follower that has exited or (with ``wait_s``, as after a failed collective)
        reported an error: its rank, pid, exit code and error. One on its way out is awaited
        up to ``wait_s`` (5 s once it has reported an error)."""
        deadline = time.monotonic() + wait_s
        out = []
        for rank, p in enumerate(self.procs, start=1):
            error = self._error(rank) if wait_s else None
            p.join(5.0 if error else max(0.0, deadline - time.monotonic()))
            if p.exitcode is not None and error is None:
                error = self._error(rank)
            if p.exitcode is None and error is None:
                continue
            state = "failed" if p.exitcode is None else f"exited with code {p.exitcode}"
            out.append(f"rank {rank} (pid {p.pid}) {state}" + (f": {error}" if error else ""))
        return out

    def _error(self, rank: int) -> str | None:
        """What rank ``rank`` reported as it failed (see `follower_main`)."""
        key = f"error/{rank}"
        if self.store is None or not self.store.check([key]):
            return None
        return self.store.get(key).decode()

    def stop(self, join_s: float = 30.0, abort: bool = False) -> None:
        """Stop the followers: None broadcast (each ends its loop and exits) or, with a broken
        group or ``abort``, the group aborted (one waiting in a collective fails out of it);
        any still there after ``join_s`` (2 s if aborted) is terminated, then killed."""
        if self.store is None:
            return
        tp, self.tp = self.tp, None
        sent = tp is not None and tp.shutdown(abort)
        for p in self.procs:
            p.join(join_s if sent else 2.0)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                with contextlib.suppress(OSError):  # a stopped process takes it once resumed
                    os.kill(p.pid, signal.SIGCONT)
                p.join(2)
            if p.is_alive():
                p.kill()
                p.join(5)
        self.store = None


def follower_main(target: Callable[..., None], args: tuple, rank: int, world: int, port: int,
                  device: str, timeout_s: float, start_timeout_s: float) -> None:
    """A spawned rank (a multiprocessing target): joins the group at rank 0's store, then runs
    ``target(tp, *args)``. An error it raises goes to the store first (for rank 0's report);
    `RankFailedError` (rank 0 gone, or it gave up on the group) goes there too but ends it
    with code 0."""
    dev = resolve_device(device, rank)
    if dev.type == "cuda":
        limit_host_threads()  # the model runs on the device; the host only feeds it
    store = dist.TCPStore("127.0.0.1", port, world, False, timedelta(seconds=start_timeout_s))
    tp = None
    try:
        store.set(f"joining/{rank}", "")
        tp = join_group(rank, world, store, dev, timeout_s, start_timeout_s, loopback=True)
        target(tp, *args)
    except RankFailedError as e:  # rank 0 hears why, should it still be there to ask
        logger.warning("tensor-parallel rank %d stops: %s", rank, e)
        with contextlib.suppress(Exception):
            store.set(f"error/{rank}", f"gave up: {e}"[:1000])
    except BaseException as e:
        with contextlib.suppress(Exception):
            store.set(f"error/{rank}", f"{type(e).__name__}: {e}"[:1000])
        raise
    finally:
        if tp is not None:
            tp.close()
