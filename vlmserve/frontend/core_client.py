"""A front end's link to the engine core: one I/O thread that owns the zmq DEALER socket.

It sends what callers queued (`add`, `abort`, `call`, ...; any thread), receives each step's
tokens, detokenizes them, applies stop strings and hands every event loop its streams'
outputs at once. It also watches the core: if the core dies, every stream ends with
`EngineDeadError` within `WATCH_S`, and the dead callbacks run first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from vlmserve.engine.messages import (
    Abort,
    Decoder,
    Encoder,
    FromCore,
    Hello,
    Ready,
    RequestFailed,
    Shutdown,
    StepOutputs,
    Utility,
    UtilityResult,
)
from vlmserve.errors import InvalidRequestError
from vlmserve.frontend.output import OutputProcessor
from vlmserve.frontend.streams import (
    EngineDeadError,
    RequestFailedError,
    RequestStream,
    RequestTiming,
    put_all,
)
from vlmserve.process import WATCH_S, CoreHandle
from vlmserve.request import Request, RequestStatus

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 3600.0  # model load (and kernel warm-up) of a large model


@dataclass
class _Live:
    """A request this front end has handed to the core: its stream and token state."""

    stream: RequestStream
    req: Request  # prompt token ids, sampling params, output tokens, status (no images)


class CoreClient:
    """The I/O thread of one front end. Starts it and waits for the core's `Ready` (its model
    loaded): `info`. `core_alive()` says whether the core's process lives."""

    def __init__(self, core: CoreHandle, core_alive: Callable[[], bool],
                 output_processor: OutputProcessor) -> None:
        self.core = core
        self._core_alive = core_alive
        self.output_processor = output_processor
        self._encoder = Encoder()
        self._live: dict[str, _Live] = {}  # owned by the I/O thread
        self._outbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._finish_callbacks: list[Callable[[RequestTiming], None]] = []
        self._dead_callbacks: list[Callable[[BaseException], None]] = []
        self._dead_lock = threading.Lock()
        self._died_of: BaseException | None = None  # set once, before the callbacks run
        self._step_callbacks: list[Callable[[float], None]] = []
        self.error: BaseException | None = None  # why the thread stopped
        self._stopping = False
        self.num_running = self.num_waiting = 0  # the core's, as of its last step
        # requests handed to `add` (callers) and taken by the I/O thread: their difference is
        # what the thread has yet to send; the other front ends' requests on the core, as of
        # its last step with this front end's tokens (and when that was)
        self._num_posted = self._num_taken = 0
        self._others, self._others_time = 0, 0.0
        self._wake_r, self._wake_w = os.pipe()
        ready: concurrent.futures.Future[Ready] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._io_loop, args=(ready,),
                                        name="vlmserve-frontend-io", daemon=True)
        self._thread.start()
        self.info: Ready = ready.result()

    # ---- callers (any thread) --------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        """False once the core is dead or shut down (checked now)."""
        return self._thread.is_alive() and self.error is None and self._core_alive()

    @property
    def num_streams(self) -> int:
        """Requests handed to the core and not finished."""
        return len(self._live)

    @property
    def load(self) -> int:
        """Requests on the core now, as this front end knows: its own in flight (sent or about
        to be) plus the other front ends' as of the core's last step with this one's tokens
        (forgotten after `WATCH_S` * 5 without such a step)."""
        others = self._others if time.monotonic() - self._others_time < 5 * WATCH_S else 0
        return len(self._live) + self._num_posted - self._num_taken + others

    def add_finish_callback(self, fn: Callable[[RequestTiming], None]) -> None:
        """`fn(timing)` runs on the I/O thread when a request finishes or is aborted."""
        self._finish_callbacks.append(fn)

    def add_step_callback(self, fn: Callable[[float], None]) -> None:
        """`fn(step_seconds)` runs on the I/O thread for each step with this front end's
        tokens: the host time of the engine core's loop iteration."""
        self._step_callbacks.append(fn)

    def add_dead_callback(self, fn: Callable[[BaseException], None]) -> None:
        """`fn(error)` runs on the I/O thread once, when the engine core is found dead (here
        and now if it already has been: a front end still starting when it died)."""
        with self._dead_lock:
            if self._died_of is None:
                self._dead_callbacks.append(fn)
                return
        fn(self._died_of)

    def add(self, stream: RequestStream, req: Request, frames: list) -> None:
        """Hand a request (its encoded `AddRequest` frames) to the core; its outputs go to
        `stream`."""
        self._num_posted += 1
        self._post(("add", _Live(stream, req), frames))

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def fail_all(self, error: BaseException) -> None:
        """End every unfinished request with `error` and abort it in the core."""
        self._post(("fail_all", error))

    def call(self, method: str) -> concurrent.futures.Future:
        """Call a method of the engine core (between two of its steps): its result, later."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = fut
        self._post(("send", self._encoder.encode(Utility(call_id, method))))
        if not self.is_running:  # died meanwhile: the I/O thread may have failed the calls
            _fail_future(fut, EngineDeadError(  # before this one came
                f"the engine is not running ({self.error or 'shut down'})"))
        return fut

    def stop(self, shutdown_core: bool, timeout: float) -> None:
        """Stop the I/O thread (and the core, if `shutdown_core`); unfinished requests end
        with `EngineDeadError`."""
        if self._thread.is_alive():
            self._post(("stop", shutdown_core))
            self._thread.join(timeout)

    def _post(self, item: tuple) -> None:
        self._outbox.put(item)
        fd = self._wake_w
        if fd >= 0:
            try:
                os.write(fd, b"x")
            except OSError:  # closed: the I/O thread has stopped
                pass

    # ---- the I/O thread --------------------------------------------------------------------

    def _io_loop(self, ready: concurrent.futures.Future[Ready]) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(self.core.address)
        self._sock = sock
        decoder = Decoder(FromCore)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        error: BaseException = EngineDeadError("the engine was shut down")
        try:
            sock.send_multipart(self._encoder.encode(Hello()))
            deadline = time.monotonic() + START_TIMEOUT_S
            while not ready.done():  # the core loads its model, then answers Hello
                if sock.poll(int(WATCH_S * 1000)):
                    msg = decoder.decode(sock.recv_multipart(copy=False))
                    assert isinstance(msg, Ready), msg
                    ready.set_result(msg)
                elif not self._core_alive() or time.monotonic() > deadline:
                    raise RuntimeError("the engine core failed to start (see its log above)")
            next_check = time.monotonic() + WATCH_S
            while True:
                events = dict(poller.poll(int(WATCH_S * 1000)))
                if self._wake_r in events:
                    os.read(self._wake_r, 65536)
                while True:
                    try:
                        item = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                    if self._handle_local(item):
                        return
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle_core(decoder.decode(frames))
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + WATCH_S
                    if not self._core_alive():
                        raise EngineDeadError("the engine core process died")
        except BaseException as e:  # noqa: BLE001 - every stream must learn the core stopped
            error = e if isinstance(e, EngineDeadError) else EngineDeadError(
                f"engine core error: {e}")
            if not ready.done():
                ready.set_exception(e)
                return
            logger.error("%s; ending %d requests", error, len(self._live))
        finally:
            self.error = error
            if not self._stopping and ready.done() and ready.exception() is None:
                with self._dead_lock:
                    self._died_of = error
                for fn in self._dead_callbacks:  # before the streams learn of it
                    fn(error)
            self._fail_everything(error)
            sock.close(0)
            ctx.term()
            wake_w, self._wake_w = self._wake_w, -1
            os.close(wake_w)
            os.close(self._wake_r)

    def _handle_local(self, item: tuple) -> bool:
        """Act on one message from a caller; True to stop the I/O thread."""
        kind = item[0]
        if kind == "add":
            self._num_taken += 1
            live, frames = item[1], item[2]
            rid = live.stream.request_id
            if rid in self._live:
                self._hand_over(live.stream._loop, [(live.stream, InvalidRequestError(
                    f"request id {rid!r} is already in use"))])
                return False
            self._live[rid] = live
            self.output_processor.add(rid)
            live.stream.timing.sent_time = time.monotonic()
            self._sock.send_multipart(frames, copy=False)
        elif kind == "abort":
            live = self._live.pop(item[1], None)
            if live is not None:
                self.output_processor.drop(item[1])
                self._sock.send_multipart(self._encoder.encode(Abort([item[1]])))
                self._finish(live.stream, "abort", time.monotonic())
        elif kind == "send":
            self._sock.send_multipart(item[1], copy=False)
        elif kind == "fail_all":
            rids = list(self._live)
            if rids:
                self._sock.send_multipart(self._encoder.encode(Abort(rids)))
            self._fail_streams(item[1])
        elif kind == "stop":
            self._stopping = True
            if item[1]:
                self._sock.send_multipart(self._encoder.encode(Shutdown()))
            return True
        return False

    def _handle_core(self, msg: Any) -> None:
        if isinstance(msg, StepOutputs):
            self._deliver(msg, time.monotonic())
        elif isinstance(msg, UtilityResult):
            fut = self._calls.pop(msg.call_id, None)
            if fut is not None and fut.set_running_or_notify_cancel():
                if msg.error is not None:
                    fut.set_exception(RuntimeError(msg.error))
                else:
                    fut.set_result(msg.result)
        elif isinstance(msg, RequestFailed):
            live = self._live.pop(msg.request_id, None)
            if live is not None:
                self.output_processor.drop(msg.request_id)
                error = (RequestFailedError if msg.in_step else InvalidRequestError)(msg.message)
                self._hand_over(live.stream._loop, [(live.stream, error)])

    def _deliver(self, msg: StepOutputs, now: float) -> None:
        """A step's tokens to text and to their streams: one hand-over per event loop, not
        one per request (each wakes the loop and costs both threads the interpreter lock)."""
        self.num_running, self.num_waiting = msg.num_running, msg.num_waiting
        self._others = max(0, msg.num_running + msg.num_waiting - len(self._live))
        self._others_time = now
        for fn in self._step_callbacks:
            fn(msg.step_time)
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        stopped: list[str] = []
        logprobs = msg.logprobs
        for rid, token, reason in zip(msg.request_ids, msg.token_ids, msg.finish_reasons):
            live = self._live.get(rid)
            if live is None:  # aborted meanwhile
                continue
            req = live.req
            req.output_token_ids.append(token)
            if req.output_logprobs is not None:  # it asked: the core sent them
                req.output_logprobs.append(logprobs[rid])
            if msg.prompt_logprobs is not None and rid in msg.prompt_logprobs:
                req.prompt_logprobs, req.prompt_logprob_ranks = msg.prompt_logprobs[rid]
            if reason is not None:
                req.status = RequestStatus(reason)
            out = self.output_processor.process(req, _mark_stopped)
            if req.status is RequestStatus.FINISHED_STOPPED and reason is None:
                stopped.append(rid)  # a stop string: the core is still running it
            stream = live.stream
            stream.timing.token_times.append(now)
            if req.status.finished:
                del self._live[rid]
                self._finish(stream, req.status.value, now)
            if out is not None:
                by_loop.setdefault(stream._loop, []).append((stream, out))
        if stopped:
            self._sock.send_multipart(self._encoder.encode(Abort(stopped, stopped=True)))
        for loop, items in by_loop.items():
            self._hand_over(loop, items)

    def _hand_over(self, loop: asyncio.AbstractEventLoop, items: list) -> None:
        try:
            loop.call_soon_threadsafe(put_all, items)
        except RuntimeError:  # its event loop is closed: nobody listens any more
            for stream, item in items:
                if not isinstance(item, BaseException):
                    self._post(("abort", stream.request_id))

    def _finish(self, stream: RequestStream, reason: str, now: float) -> None:
        stream.timing.finished_time = now
        stream.timing.finish_reason = reason
        for fn in self._finish_callbacks:
            try:
                fn(stream.timing)
            except Exception:  # noqa: BLE001 - metrics must not stop the front end
                logger.exception("finish callback failed")

    def _fail_streams(self, error: BaseException) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        now = time.monotonic()
        for rid, live in list(self._live.items()):
            self.output_processor.drop(rid)
            self._finish(live.stream, "abort", now)
            by_loop.setdefault(live.stream._loop, []).append((live.stream, error))
        self._live.clear()
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(put_all, items)
            except RuntimeError:
                pass

    def _fail_everything(self, error: BaseException) -> None:
        self._fail_streams(error)
        for fut in list(self._calls.values()):
            _fail_future(fut, error)
        self._calls.clear()
        while True:  # callers' messages the thread will not see
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "add":
                self._hand_over(item[1].stream._loop, [(item[1].stream, error)])


def _mark_stopped(req: Request) -> None:
    req.status = RequestStatus.FINISHED_STOPPED


def _fail_future(fut: concurrent.futures.Future, error: BaseException) -> None:
    """End `fut` with `error` unless another thread has already ended (or cancelled) it."""
    try:
        if fut.set_running_or_notify_cancel():
            fut.set_exception(error)
    except (RuntimeError, concurrent.futures.InvalidStateError):
        pass
