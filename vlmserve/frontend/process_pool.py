"""A pool of worker processes that survives their deaths: each process runs one task at a
time, so when one dies (killed, or crashed by its task's input) only the task it was running
is touched. That task is retried once on another process (it may have been innocent: a kill
from outside); a task that kills a process twice fails with `WorkerDiedError`; the dead
process is replaced. (`concurrent.futures.ProcessPoolExecutor` instead fails every pending
task and stays broken when one of its processes dies.)"""

from __future__ import annotations

import collections
import logging
import multiprocessing as mp
import multiprocessing.connection
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

logger = logging.getLogger(__name__)
MAX_DEATHS = 2  # a task that kills this many processes fails
START_BACKOFF_S = (1.0, 30.0)  # after a process fails to start: wait, doubling up to


class WorkerDiedError(RuntimeError):
    """A task's process died running it, twice."""


def _worker_main(conn: Any, initializer: Callable[..., Any] | None,
                 initargs: Sequence[Any]) -> None:
    """A pool process: the initializer, "ready", then (fn, args) after another, each answered
    (True, result) or (False, exception)."""
    if initializer is not None:
        initializer(*initargs)
    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        fn, args = task
        try:
            reply = (True, fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            reply = (False, e)
        try:
            conn.send(reply)
        except Exception as e:  # noqa: BLE001 - the result does not pickle
            conn.send((False, RuntimeError(f"{type(e).__name__}: {e}")))


class _Task:
    __slots__ = ("fn", "args", "future", "deaths")

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn, self.args, self.future, self.deaths = fn, args, Future(), 0


class ProcessPool:
    """`workers` processes (spawned; each runs ``initializer(*initargs)`` first), fed tasks in
    order by a thread each. `submit` returns a `concurrent.futures.Future`; with ``wait``,
    the constructor returns once every process is ready."""

    def __init__(self, workers: int, initializer: Callable[..., Any] | None = None,
                 initargs: Sequence[Any] = (), wait: bool = True, name: str = "pool") -> None:
        self._initializer, self._initargs, self._name = initializer, tuple(initargs), name
        self._ctx = mp.get_context("spawn")
        self._cond = threading.Condition()
        self._queue: collections.deque[_Task] = collections.deque()
        self._procs: dict[int, mp.process.BaseProcess] = {}  # slot -> its live process
        self._ready = 0
        self._start_error: Exception | None = None  # the first failed start
        self._closed = False
        self._threads = [threading.Thread(target=self._serve, args=(i,), daemon=True,
                                          name=f"{name}-{i}") for i in range(workers)]
        for t in self._threads:
            t.start()
        if wait:
            with self._cond:
                self._cond.wait_for(lambda: self._ready >= workers or self._closed
                                    or self._start_error is not None)
                error = self._start_error
            if error is not None:
                self.shutdown()
                raise RuntimeError(f"a {name} process did not start: {error}")

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        task = _Task(fn, args)
        with self._cond:
            if self._closed:
                raise RuntimeError("the pool is shut down")
            self._queue.append(task)
            self._cond.notify_all()
        return task.future

    def pids(self) -> list[int]:
        """The pool's live processes."""
        with self._cond:
            return [p.pid for p in self._procs.values() if p.pid is not None]

    def shutdown(self) -> None:
        """Stop every process (they hold nothing) and fail the tasks still queued."""
        with self._cond:
            self._closed = True
            queued, self._queue = list(self._queue), collections.deque()
            procs = list(self._procs.values())
            self._cond.notify_all()
        for task in queued:
            task.future.cancel()
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)

    # ---- a process's thread ----------------------------------------------------------------

    def _serve(self, slot: int) -> None:
        proc, conn = None, None
        failures = 0
        while True:
            if proc is None:
                with self._cond:
                    if self._closed:
                        return
                try:
                    proc, conn = self._start(slot)
                    failures = 0
                except Exception as e:  # noqa: BLE001 - logged; tried again
                    failures += 1
                    with self._cond:
                        self._start_error = self._start_error or e
                        self._cond.notify_all()
                    delay = min(START_BACKOFF_S[0] * 2 ** (failures - 1), START_BACKOFF_S[1])
                    logger.error("a %s process did not start (%s); again in %.0f s",
                                 self._name, e, delay)
                    with self._cond:
                        self._cond.wait_for(lambda: self._closed, timeout=delay)
                    continue
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                task = self._queue.popleft()
            if task.deaths == 0 and not task.future.set_running_or_notify_cancel():
                continue  # cancelled while it waited
            if self._run(proc, conn, task):
                continue
            # the process died running it
            conn.close()
            proc.join(5)
            with self._cond:
                if self._procs.get(slot) is proc:
                    del self._procs[slot]
                task.deaths += 1
                retry = task.deaths < MAX_DEATHS and not self._closed
                if retry:
                    self._queue.appendleft(task)
                    self._cond.notify_all()
            if not self._closed:
                logger.error("a %s process (pid %s) died running a task (exit code %s)%s",
                             self._name, proc.pid, proc.exitcode,
                             "; it is retried" if retry else "; it fails")
            if self._closed:
                task.future.set_exception(RuntimeError(f"the {self._name} pool was shut down"))
            elif not retry:
                task.future.set_exception(WorkerDiedError(
                    f"its {self._name} process died twice running it (killed, or its input "
                    "crashes it)"))
            proc, conn = None, None

    def _start(self, slot: int) -> tuple[mp.process.BaseProcess, Any]:
        ours, theirs = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, name=f"vlmserve-{self._name}-{slot}",
                                 args=(theirs, self._initializer, self._initargs),
                                 daemon=True)
        proc.start()
        theirs.close()
        ready = mp.connection.wait([ours, proc.sentinel])
        if ours not in ready:
            proc.join(5)
            ours.close()
            raise RuntimeError(f"exit code {proc.exitcode}")
        try:
            ours.recv()
        except EOFError:
            proc.join(5)
            ours.close()
            raise RuntimeError(f"exit code {proc.exitcode}") from None
        with self._cond:
            self._procs[slot] = proc
            self._ready += 1
            self._cond.notify_all()
            closed = self._closed
        if closed:
            proc.terminate()
        return proc, ours

    def _run(self, proc: mp.process.BaseProcess, conn: Any, task: _Task) -> bool:
        """``task`` in ``proc``, its future settled; False if the process died running it."""
        try:
            conn.send((task.fn, task.args))
        except (OSError, EOFError):
            return False
        except Exception as e:  # noqa: BLE001 - the task does not pickle
            task.future.set_exception(e)
            return True
        while True:
            ready = mp.connection.wait([conn, proc.sentinel])
            if conn in ready:
                try:
                    ok, value = conn.recv()
                except (EOFError, OSError):
                    return False
                break
            if not proc.is_alive():
                # it may have answered just before it died
                if conn.poll(0):
                    continue
                return False
            time.sleep(0.001)
        if ok:
            task.future.set_result(value)
        else:
            task.future.set_exception(value)
        return True
