"""A front end's clients of several engine cores (`--data-parallel-size N`): one `CoreClient`
(an I/O thread, a socket) per core behind the interface `AsyncLLM`, the metrics and the server
use of one, and the router (`core/dp_routing.py`) that picks each request's core.

A core that dies fails its own requests (its client ends their streams); the router leaves it
out and the others serve on. The callbacks for a dead engine run once every core is dead.
`get_stats` is every live core's stats summed (`merge_stats`), with each core's own under
`cores` and the router's decisions under `routing`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

from vlmserve.core.dp_routing import AffinityRouter, Route, RouteKey
from vlmserve.frontend.core_client import CoreClient
from vlmserve.frontend.streams import EngineDeadError, RequestStream, RequestTiming
from vlmserve.request import Request

logger = logging.getLogger(__name__)

# stats of a core that are not summed over cores: (how they combine)
_MEAN = ("kv_cache_usage",)
_MAX = ("stalled_s", "time")
_OWN = ("pid", "replica", "core")  # a core's or replica's own: not in the total


def merge_stats(per_core: list[dict[str, Any] | None]) -> dict[str, Any]:
    """The engine's stats over cores (None: a dead core): counts summed, the KV cache's usage
    averaged, stall time the longest, the prefix cache's hit rate over the summed tokens;
    each core's own under ``cores`` (``alive`` says which answered)."""
    live = [s for s in per_core if s is not None]
    total: dict[str, Any] = {}
    for key in live[0] if live else ():
        values = [s.get(key) for s in live]
        if key in _OWN:
            continue
        if any(v is None for v in values) or isinstance(values[0], bool):
            total[key] = values[0]
        elif not isinstance(values[0], int | float):
            continue
        elif key in _MEAN:
            total[key] = sum(values) / len(values)
        elif key in _MAX:
            total[key] = max(values)
        else:
            total[key] = sum(values)
    if "prefix_cache_queried_tokens" in total:
        total["prefix_cache_hit_rate"] = (total["prefix_cache_hit_tokens"]
                                          / max(total["prefix_cache_queried_tokens"], 1))
    total["cores"] = [{"core": i, "alive": s is not None, **(s or {})}
                      for i, s in enumerate(per_core)]
    return total


class DataParallelClient:
    """`CoreClient`s of N engine cores as one, and the router over them."""

    def __init__(self, clients: list[CoreClient], router: AffinityRouter) -> None:
        self.clients, self.router = clients, router
        self.info = clients[0].info  # every core serves the same model with the same limits
        self._lock = threading.Lock()  # the router's tables: event loops and I/O threads
        self._dead_callbacks: list[Callable[[BaseException], None]] = []
        self._died_of: BaseException | None = None
        for i, client in enumerate(clients):
            client.add_dead_callback(lambda e, i=i: self._core_died(i, e))

    # ---- one core's death (on its I/O thread) ---------------------------------------------

    def _core_died(self, index: int, error: BaseException) -> None:
        with self._lock:
            self.router.set_alive(index, False)
            left = sum(self.router.alive(i) for i in range(len(self.clients)))
            callbacks = []
            if left == 0 and self._died_of is None:
                self._died_of = error
                callbacks = list(self._dead_callbacks)
        logger.error("engine core %d (pid %d) is gone (%s): its requests failed; %d of %d "
                     "cores serve on", index, self.clients[index].info.pid, error, left,
                     len(self.clients))
        for fn in callbacks:
            fn(error)

    # ---- the CoreClient interface ----------------------------------------------------------

    @property
    def is_running(self) -> bool:
        """True while any core runs."""
        return any(c.is_running for c in self.clients)

    @property
    def error(self) -> BaseException | None:
        return self._died_of or next((c.error for c in self.clients if c.error), None)

    @property
    def num_streams(self) -> int:
        return sum(c.num_streams for c in self.clients)

    def add_finish_callback(self, fn: Callable[[RequestTiming], None]) -> None:
        for c in self.clients:
            c.add_finish_callback(fn)

    def add_step_callback(self, fn: Callable[[float], None]) -> None:
        for c in self.clients:
            c.add_step_callback(fn)

    def add_dead_callback(self, fn: Callable[[BaseException], None]) -> None:
        """`fn(error)` once every core is dead (now if they are)."""
        with self._lock:
            if self._died_of is None:
                self._dead_callbacks.append(fn)
                return
        fn(self._died_of)

    def route(self, key: RouteKey) -> Route:
        """The core for a request with this key (see `AffinityRouter`); `EngineDeadError`
        when none is alive."""
        loads = [c.load for c in self.clients]
        with self._lock:
            try:
                return self.router.choose(key, loads)
            except LookupError:
                raise EngineDeadError("the engine is not running (every engine core is "
                                      "gone)") from None

    def add(self, stream: RequestStream, req: Request, frames: list, core: int) -> None:
        self.clients[core].add(stream, req, frames)

    def abort(self, request_id: str) -> None:  # the core that has it sends the abort
        for c in self.clients:
            if c.is_running:
                c.abort(request_id)

    def fail_all(self, error: BaseException) -> None:
        for c in self.clients:
            c.fail_all(error)

    def call(self, method: str) -> concurrent.futures.Future:
        """Call a method of every live core: `get_stats` merged (`merge_stats`), else the
        first core's result. `reset_prefix_cache` also empties the router's tables."""
        alive = [i for i, c in enumerate(self.clients) if c.is_running]
        if not alive:
            raise EngineDeadError(f"the engine is not running ({self.error or 'shut down'})")
        futures = {i: self.clients[i].call(method) for i in alive}
        out: concurrent.futures.Future = concurrent.futures.Future()
        guard = threading.Lock()  # the last two may finish at once, on two I/O threads

        def done(_: concurrent.futures.Future) -> None:
            with guard:
                if not all(f.done() for f in futures.values()) or out.done():
                    return
                _combine()

        def _combine() -> None:
            results: list[Any] = [None] * len(self.clients)
            for i, f in futures.items():
                if f.exception() is None:
                    results[i] = f.result()
                elif not isinstance(f.exception(), EngineDeadError):  # died meanwhile: None
                    out.set_exception(f.exception())
                    return
            if method == "get_stats":
                result: Any = self._stats(results)
            else:
                if method == "reset_prefix_cache":
                    with self._lock:
                        self.router.forget()
                result = next((r for r in results if r is not None), None)
            out.set_result(result)

        for f in futures.values():
            f.add_done_callback(done)
        return out

    def _stats(self, results: list[dict | None]) -> dict[str, Any]:
        stats = merge_stats(results)
        for i, core in enumerate(stats["cores"]):
            core.update(pid=self.clients[i].info.pid, num_streams=self.clients[i].num_streams,
                        load=self.clients[i].load)
        with self._lock:
            stats["routing"] = self.router.stats()
        stats["data_parallel_size"] = len(self.clients)
        return stats

    def stop(self, shutdown_core: bool, timeout: float) -> None:
        for c in self.clients:
            c.stop(shutdown_core, timeout)
