"""An asyncio front for `LLMEngine`: one background thread owns the engine and runs its step loop.

The engine is not thread-safe, so every call into it (construction, admission, abort, `step`,
stats, chat templates) happens on that one thread. Preprocessing (image decoding and
processing, tokens) runs there too, mostly while the device works on a step
(`LLMEngine.step(while_waiting=...)`): on other threads it would contend with the step loop for
the GIL, which cost the offline path a fifth of its time (docs/benchmarks.md, W1). Callers
hand it work through a `queue.SimpleQueue` (thread-safe, and safe from `__del__`); the thread
loops `step()` while any request is unfinished and blocks on the queue when idle. Each
request's outputs go to an `asyncio.Queue` on the caller's event loop through
`loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from vlmserve.config import EngineConfig
from vlmserve.engine.llm_engine import LLMEngine
from vlmserve.engine.processor import PromptInput
from vlmserve.outputs import RequestOutput
from vlmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down, or an internal error in a step)."""


@dataclass
class RequestTiming:
    """Per-request timing (`time.monotonic()` seconds) and token counts, for metrics."""

    arrival_time: float
    num_prompt_tokens: int = 0
    token_times: list[float] = field(default_factory=list)  # when each output token came out
    finished_time: float | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" once finished

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def ttft(self) -> float | None:
        first = self.first_token_time
        return None if first is None else first - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


def _put_all(items: list[tuple[RequestStream, Any]]) -> None:  # on the event loop
    for stream, item in items:
        stream._put(item)


class RequestStream:
    """Async iterator over one request's cumulative `RequestOutput`s.

    Leaving the iteration early (`aclose()`, `abort()`, cancellation, or dropping the stream)
    aborts the request in the engine, which frees its KV blocks and encoder cache references.
    """

    def __init__(self, engine: AsyncLLMEngine, request_id: str,
                 loop: asyncio.AbstractEventLoop, timing: RequestTiming) -> None:
        self.engine = engine
        self.request_id = request_id
        self.timing = timing
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False

    def _put(self, item: Any) -> None:  # on the event loop
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled while waiting: the consumer is gone
            self.abort()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Stop the request now (no-op once finished)."""
        if not self.finished:
            self.finished = True
            self.engine._inbox.put(("abort", self.request_id))

    async def aclose(self) -> None:
        self.abort()

    def __del__(self) -> None:
        if not self.finished:
            self.engine._inbox.put(("abort", self.request_id))


class AsyncLLMEngine:
    """Runs an `LLMEngine` on a dedicated thread; `generate` streams outputs to asyncio code.

    Build it with `AsyncLLMEngine(config)` or `AsyncLLMEngine.from_kwargs(model=..., ...)`
    (the same option names as `LLM(...)`); the model loads on the engine thread.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # owned by the engine thread
        self._ids = itertools.count()
        self._stats: dict[str, Any] = {}
        self._stats_lock = threading.Lock()
        self._finish_callbacks: list[Callable[[RequestTiming], None]] = []
        self._error: BaseException | None = None
        self._engine: LLMEngine | None = None  # stepped only by the engine thread
        self._adds: deque[tuple] = deque()  # "add" messages not yet preprocessed (engine thread)
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(ready,),
                                        name="vlmserve-engine", daemon=True)
        self._thread.start()
        ready.result()
        assert self._engine is not None
        self.max_model_len: int = self._engine.max_model_len
        self.model_name: str = config.model_config.model

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> AsyncLLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    # ---- the API (any thread / event loop) -------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def add_finish_callback(self, fn: Callable[[RequestTiming], None]) -> None:
        """`fn(timing)` runs on the engine thread when a request finishes or is aborted."""
        self._finish_callbacks.append(fn)

    async def add_request(self, prompt: PromptInput, params: SamplingParams | None = None,
                          request_id: str | None = None) -> RequestStream:
        """Admit a request and return its stream. Bad input raises the engine's
        `InvalidRequestError` here, before any output."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        stream = RequestStream(self, rid, loop, RequestTiming(time.monotonic()))
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._submit(("add", stream, prompt, params, fut))
        try:
            await asyncio.wrap_future(fut)
        except BaseException:
            stream.finished = True
            if not (fut.done() and not fut.cancelled() and fut.exception() is not None):
                self._inbox.put(("abort", rid))  # cancelled: undo the admission if it happened
            raise
        return stream

    async def generate(self, prompt: PromptInput, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs of one request (the last has `finished=True`)."""
        stream = await self.add_request(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        self._check_alive()
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._submit(("call", fn, fut))
        return await asyncio.wrap_future(fut)

    def get_stats(self) -> dict[str, Any]:
        """A snapshot of the engine's stats, refreshed by the engine thread after every step,
        admission and abort."""
        with self._stats_lock:
            return dict(self._stats)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread; unfinished requests end with `EngineDeadError`."""
        if self._thread.is_alive():
            self._inbox.put(("stop",))
            self._thread.join(timeout)

    def _check_alive(self) -> None:
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self._error or 'shut down'})")

    def _submit(self, item: tuple) -> None:
        self._inbox.put(item)
        if self._error is not None:  # the thread died meanwhile: fail what it will not see
            self._fail_pending(EngineDeadError(f"the engine is not running ({self._error})"))

    # ---- the engine thread -----------------------------------------------------------------

    def _run(self, ready: concurrent.futures.Future[None]) -> None:
        try:
            self._engine = LLMEngine(self.config)
            self._refresh_stats()
        except BaseException as e:
            self._error = e
            ready.set_exception(e)
            return
        ready.set_result(None)
        engine = self._engine
        flush = False  # an abort left state for the worker to drop: step once more
        try:
            while True:
                busy = engine.has_unfinished_requests() or flush or bool(self._adds)
                items = [] if busy else [self._inbox.get()]
                while True:
                    try:
                        items.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                for i, item in enumerate(items):
                    if item[0] == "stop":
                        for rest in items[i + 1:]:  # failed below with everything queued
                            self._inbox.put(rest)
                        raise EngineDeadError("the engine was shut down")
                    flush |= self._handle(engine, item)
                while self._adds and engine.scheduler.needs_requests():
                    self._admit_next(engine)
                if engine.has_unfinished_requests() or flush:
                    flush = False
                    outputs = engine.step(self._admit_ahead)
                    self._deliver(outputs, time.monotonic())
                self._refresh_stats()
        except BaseException as e:  # noqa: BLE001 - every stream must learn the engine stopped
            if not isinstance(e, EngineDeadError):
                logger.exception("engine loop failed; the engine stops")
            self._error = e
            err = e if isinstance(e, EngineDeadError) else EngineDeadError(f"engine error: {e}")
            for stream in list(self._streams.values()):
                self._hand_over(stream._loop, [(stream, err)])
            self._streams.clear()
            self._fail_pending(err)
        finally:
            engine.shutdown()  # tensor-parallel worker processes, if any

    def _handle(self, engine: LLMEngine, item: tuple) -> bool:
        """Act on one inbox message; True if the worker has state to drop."""
        kind = item[0]
        if kind == "add":
            self._adds.append(item)  # preprocessed and admitted in arrival order
        elif kind == "abort":
            rid = item[1]
            stream = self._streams.pop(rid, None)
            if rid in engine.scheduler.requests:
                engine.abort_request(rid)
                if stream is not None:
                    self._finish(stream, "abort", time.monotonic())
                return True
        elif kind == "call":
            _, fn, fut = item
            if not fut.set_running_or_notify_cancel():
                return False
            try:
                fut.set_result(fn(engine))
            except BaseException as e:  # noqa: BLE001 - reported to the caller
                fut.set_exception(e)
        return False

    def _admit_next(self, engine: LLMEngine) -> bool:
        """Preprocess and admit the oldest pending request; False if there is none. Bad
        input (or a request id in use) fails the caller's future, not the engine."""
        if not self._adds:
            return False
        _, stream, prompt, params, fut = self._adds.popleft()
        if not fut.set_running_or_notify_cancel():  # the caller gave up before admission
            return True
        try:
            if stream.request_id in engine.scheduler.requests:
                raise ValueError(f"request id {stream.request_id!r} is already in use")
            engine.add_processed_request(
                engine.process_request(prompt, params, stream.request_id))
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            fut.set_exception(e)
            return True
        req = engine.scheduler.requests[stream.request_id]
        stream.timing.num_prompt_tokens = req.num_prompt_tokens
        self._streams[stream.request_id] = stream
        fut.set_result(None)
        return True

    def _admit_ahead(self) -> bool:
        """While the device runs a step: one more pending request, if there is room ahead."""
        assert self._engine is not None
        return self._engine.scheduler.has_room_ahead() and self._admit_next(self._engine)

    def _deliver(self, outputs: list[RequestOutput], now: float) -> None:
        """A step's outputs to their streams: one hand-over per event loop, not one per
        request (each wakes the loop and costs both threads the interpreter lock)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.timing.token_times.append(now)
            if out.finished:  # callbacks first: metrics are current when the caller sees it
                del self._streams[out.request_id]
                self._finish(stream, out.outputs[0].finish_reason or "stop", now)
            by_loop.setdefault(stream._loop, []).append((stream, out))
        for loop, items in by_loop.items():
            self._hand_over(loop, items)

    def _hand_over(self, loop: asyncio.AbstractEventLoop, items: list) -> None:
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # its event loop is closed: nobody listens any more
            for stream, item in items:
                if not isinstance(item, BaseException) and stream.request_id in self._streams:
                    self._inbox.put(("abort", stream.request_id))

    def _finish(self, stream: RequestStream, reason: str, now: float) -> None:
        stream.timing.finished_time = now
        stream.timing.finish_reason = reason
        for fn in self._finish_callbacks:
            try:
                fn(stream.timing)
            except Exception:  # noqa: BLE001 - metrics must not stop the engine
                logger.exception("finish callback failed")

    def _fail_pending(self, err: BaseException) -> None:
        while True:  # also from a caller's thread once the engine thread is gone
            try:
                fut = self._adds.popleft()[-1]
            except IndexError:
                break
            if fut.set_running_or_notify_cancel():
                fut.set_exception(err)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] in ("add", "call") and item[-1].set_running_or_notify_cancel():
                item[-1].set_exception(err)

    def _refresh_stats(self) -> None:
        assert self._engine is not None
        stats = self._engine.get_stats()
        stats["num_streams"] = len(self._streams)
        with self._stats_lock:
            self._stats = stats
