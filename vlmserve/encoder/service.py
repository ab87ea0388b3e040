"""The encoder server's core process: the `MultimodalEncoder` (tower, ledger, delivered images)
with nothing else on its interpreter, behind a zmq ROUTER socket.

The HTTP front end (`entrypoints/openai/encoder_server.py`) reads and checks requests, decodes
image URLs and turns every image into pixels (`PixelImage`); this process batches the images
of every job that waits into tower forwards, exports a handle per image and answers each job
with its handles (wire form). In one process with the HTTP event loop, the tower's launch lost
the interpreter lock to the loop on nearly every torch call (each call releases and takes it
back): 4 images took 17 times as long on the CPU beside one busy Python thread
(`benchmarks/encoder_forward.py`).

    front end --EncodeJob / StatsCall / Stop--> core
    front end <--JobDone / StatsReply---------- core      (msgspec msgpack over ipc://)

Its process has the engine core's skeleton (process.py: spawned by name, signals, the ROUTER
socket and its idle loop): it dies with its parent (PR_SET_PDEATHSIG, and a check of the parent
pid while idle); the front end checks the core's pid every `WATCH_S` and, if it is gone, fails
what waits and answers 503 (`EncoderCoreDead`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch
import zmq
import zmq.asyncio

from vlmserve.multimodal.inputs import ImageInput, ProcessedPrompt
from vlmserve.process import WATCH_S, run_core, start_core
from vlmserve.transfer.wire import HandleWire, PixelImage, to_wire
from vlmserve.utils import pid_alive

logger = logging.getLogger("vlmserve.encoder_core")


class EncodeJob(msgspec.Struct, tag=True):
    """One request's images to encode (pixels checked by the front end)."""
    job_id: int
    transport: str
    images: list[PixelImage]
    consumer: str | None = None  # images it holds are answered None, not encoded
    consumer_rows: int | None = None
    sent_at: float = 0.0  # time.monotonic() at the front end (one clock per host)
    received_at: float = 0.0  # when the front end received its HTTP request (same clock)


class JobDone(msgspec.Struct, tag=True):
    job_id: int
    handles: list[HandleWire | None]  # per image; None: the consumer holds it
    error: str | None = None


class StatsCall(msgspec.Struct, tag=True):
    call_id: int


class StatsReply(msgspec.Struct, tag=True):
    call_id: int
    stats: dict[str, Any]


class Stop(msgspec.Struct, tag=True):
    pass


ToCore = EncodeJob | StatsCall | Stop
FromCore = JobDone | StatsReply


class EncoderCoreDead(RuntimeError):
    """The encoder core process is gone."""


@dataclasses.dataclass
class ServerTimes:
    """Where a job's time goes (seconds, summed over every front end's jobs): from the
    front end's receipt of its HTTP request to the core's answer (`request_s`), its wait from
    the front end's send to its forward's launch (`queue_s`), and the forwards (`forward_s`:
    launch to exported, the wait behind the forward launched before it included)."""
    requests: int = 0
    request_s: float = 0.0
    jobs: int = 0
    queue_s: float = 0.0
    forwards: int = 0
    forward_s: float = 0.0
    max_jobs_per_forward: int = 0

    def summary(self) -> dict[str, float]:
        def ms(total: float, n: int) -> float:
            return round(1e3 * total / n, 3) if n else 0.0
        return {**dataclasses.asdict(self), "mean_request_ms": ms(self.request_s, self.requests),
                "mean_queue_ms": ms(self.queue_s, self.jobs),
                "mean_forward_ms": ms(self.forward_s, self.forwards)}


def forwards(jobs: list[EncodeJob], max_rows: int) -> list[list[EncodeJob]]:
    """The waiting jobs as tower forwards, in arrival order: one per handle kind asked, each
    of at most ``max_rows`` image rows (a job larger than that alone), so a burst of
    requests is neither one unbounded forward nor one forward per request."""
    out: list[list[EncodeJob]] = []
    for transport in dict.fromkeys(j.transport for j in jobs):
        group: list[EncodeJob] = []
        rows = 0
        for job in (j for j in jobs if j.transport == transport):
            n = sum(img.length for img in job.images)
            if group and rows + n > max_rows:
                out.append(group)
                group, rows = [], 0
            group.append(job)
            rows += n
        out.append(group)
    return out


class EncoderCoreProc:
    """One `MultimodalEncoder` behind the process's ROUTER socket (`run_core` runs the
    loop): read every waiting message, encode the jobs among them, answer."""

    def __init__(self, encoder: Any, sock: zmq.Socket) -> None:
        self.encoder = encoder
        self.transform = encoder.model_processor.pixel_transform
        self.times = ServerTimes()
        self.sock = sock
        self.enc = msgspec.msgpack.Encoder()
        self.dec = msgspec.msgpack.Decoder(ToCore)
        self.stopping = False
        self.sender: dict[int, bytes] = {}  # by id() of a job until it is answered
        self.pending: list[tuple] = []  # (group, held, launched, launch time) a forward

    def busy(self) -> bool:
        return bool(self.pending)

    def step(self) -> None:
        """Read every waiting message, launch the forwards of the jobs among them, then
        export and answer the forwards launched the round before: the device always has
        the next forward queued while the host exports, answers and reads messages."""
        jobs = self._receive()
        launched = [self._launch(group) for group in
                    forwards(jobs, self.encoder.max_rows_per_forward)]
        self._finish_all(self.pending)
        self.pending = [item for item in launched if item is not None]
        # on the CPU a launch computed: answer now; and before a stop
        if self.encoder.device.type != "cuda" or self.stopping:
            self._finish_all(self.pending)
            self.pending = []

    def _finish_all(self, launched: list[tuple]) -> None:
        for item in launched:
            self._finish(*item)

    def _receive(self) -> list[EncodeJob]:
        """Every waiting message handled; the jobs among them, in arrival order."""
        jobs = []
        while True:
            try:
                identity, frame = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return jobs
            msg = self.dec.decode(frame)
            if isinstance(msg, EncodeJob):
                self.sender[id(msg)] = identity  # job ids are per front end
                jobs.append(msg)
            elif isinstance(msg, StatsCall):
                self._send(identity, StatsReply(msg.call_id, self.stats()))
            else:
                self.stopping = True

    def _launch(self, group: list[EncodeJob]) -> tuple | None:
        """The group's images its consumers do not hold, in one forward (queued). Only the
        job at fault fails: a job whose images cannot be read is answered with its error,
        and a forward that fails is run again one job at a time (`_one_by_one`)."""
        t = self.times
        began = time.monotonic()
        t.jobs += len(group)
        t.queue_s += sum(max(0.0, began - job.sent_at) for job in group)
        group, held, prompts = self._readable(group)
        if not group:
            return None
        try:
            return group, held, self.encoder.launch(prompts, transport=group[0].transport), began
        except Exception as e:  # noqa: BLE001 - each waiting request is told
            self._one_by_one(group, e, began)
            return None

    def _readable(self, group: list[EncodeJob]
                  ) -> tuple[list[EncodeJob], list[set[str]], list[ProcessedPrompt]]:
        """The group's jobs whose images can be read (the others answered with their error),
        the images each one's consumer holds, and each one's images to encode."""
        enc = self.encoder
        jobs, held, prompts = [], [], []
        for job in group:
            try:
                known = (enc.delivered.known(job.consumer, job.consumer_rows,
                                             [img.mm_hash for img in job.images])
                         if job.consumer is not None else set())
                prompt = ProcessedPrompt(None, [], [self._image(img) for img in job.images
                                                    if img.mm_hash not in known])
            except Exception as e:  # noqa: BLE001 - this job's own fault
                self._failed([job], e)
                continue
            jobs.append(job)
            held.append(known)
            prompts.append(prompt)
        return jobs, held, prompts

    def _one_by_one(self, group: list[EncodeJob], error: Exception, began: float) -> None:
        """A forward of ``group`` failed with ``error``: alone, its job fails; else each job
        is launched and finished alone, so that only the one at fault fails."""
        if len(group) == 1:
            self._failed(group, error)
            return
        logger.warning("a forward of %d jobs failed (%s: %s); each job again alone",
                       len(group), type(error).__name__, error)
        for job in group:
            jobs, held, prompts = self._readable([job])
            if not jobs:
                continue
            try:
                work = self.encoder.launch(prompts, transport=job.transport)
            except Exception as e:  # noqa: BLE001 - this job's own fault
                self._failed(jobs, e)
                continue
            self._finish(jobs, held, work, began)

    def _finish(self, group: list[EncodeJob], held: list[set[str]], work: Any,
                began: float) -> None:
        """Export the group's forward and answer each job with its handles (a failure:
        `_one_by_one`)."""
        enc, t = self.encoder, self.times
        try:
            outputs = enc.finish(work)
        except Exception as e:  # noqa: BLE001 - each waiting request is told
            self._one_by_one(group, e, began)
            return
        t.forwards += 1
        t.forward_s += time.monotonic() - began
        t.max_jobs_per_forward = max(t.max_jobs_per_forward, len(group))
        for job, known, out in zip(group, held, outputs, strict=True):
            if job.consumer is not None:
                enc.delivered.exported(job.consumer, [(e.handle.handle_id, e.mm_hash, e.length)
                                                      for e in out.images])
            handles = iter(out.images)
            self._answer(job, JobDone(job.job_id, [
                None if img.mm_hash in known else to_wire(next(handles).handle)
                for img in job.images]))

    def _failed(self, group: list[EncodeJob], e: Exception) -> None:
        logger.exception("encoding failed")
        for job in group:
            self._answer(job, JobDone(job.job_id, [], f"{type(e).__name__}: {e}"))

    def _answer(self, job: EncodeJob, done: JobDone) -> None:
        answered = time.monotonic()  # before the send: once sent, the client may have it
        self._send(self.sender.pop(id(job)), done)
        if job.received_at:
            self.times.requests += 1
            self.times.request_s += answered - job.received_at

    def _image(self, img: PixelImage) -> ImageInput:
        pixels = torch.frombuffer(bytearray(img.pixels), dtype=torch.uint8).view(img.shape)
        return ImageInput(img.mm_hash, 0, img.length, pixels, tuple(img.encoder_meta),
                          self.transform)

    def stats(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.encoder.get_stats()), "server": self.times.summary(),
                "core_pid": os.getpid()}

    def _send(self, identity: bytes, msg: Any) -> None:
        self.sock.send_multipart([identity, self.enc.encode(msg)], copy=False)

    def close(self) -> None:
        self.encoder.shutdown()  # every live handle reclaimed


def run_encoder_core(address: str, parent_pid: int, kwargs: dict[str, Any], conn: Any,
                     log_level: str = "info") -> None:
    """The core process's entry point (`start_encoder_core` spawns it by name): it loads the
    encoder, says ("ready", pid) or ("error", why) on ``conn``, then serves until `Stop`,
    SIGTERM or its parent's death; every live handle is reclaimed as it ends."""
    from vlmserve.encoder.encoder import MultimodalEncoder

    run_core(lambda sock: EncoderCoreProc(MultimodalEncoder(**kwargs), sock), address,
             parent_pid, "encoder core", kwargs.get("device", "auto"), log_level, conn)


def start_encoder_core(kwargs: dict[str, Any], log_level: str = "info",
                       timeout_s: float = 1800.0) -> tuple[mp.process.BaseProcess, str]:
    """Spawn the core process (it dies with this one) and wait for its encoder to load;
    raises `RuntimeError` with the core's own error if it fails to start."""
    ours, theirs = mp.get_context("spawn").Pipe(duplex=False)
    proc, core = start_core("vlmserve.encoder.service:run_encoder_core",
                            "vlmserve-encoder-core", kwargs, theirs, log_level)
    theirs.close()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ours.poll(0.2):
            try:
                kind, value = ours.recv()
            except EOFError:
                break
            if kind == "ready":
                return proc, core.address
            proc.join(5)
            raise RuntimeError(f"the encoder core failed to start: {value}")
        if not proc.is_alive():
            break
    proc.kill()
    proc.join(5)
    raise RuntimeError(f"the encoder core did not start (exit code {proc.exitcode})")


class EncoderCoreClient:
    """The front end's side, on its event loop: jobs and stats calls to the core, answers
    matched by id; `dead` once the core is gone (everything waiting fails with
    `EncoderCoreDead`, and ``on_dead`` is called once). Several front ends may share a core:
    each connects a socket of its own."""

    def __init__(self, address: str, pid: int,
                 on_dead: Callable[[EncoderCoreDead], None] | None = None,
                 owns_core: bool = True) -> None:
        self.address, self.pid, self.on_dead = address, pid, on_dead
        self.owns_core = owns_core  # `close` stops the core (else its supervisor does)
        self.dead: EncoderCoreDead | None = None
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}  # by job or call id (one counter)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(FromCore)
        self._tasks: list[asyncio.Task] = []
        self._sock: zmq.asyncio.Socket | None = None

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.address)
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]

    async def encode(self, images: list[PixelImage], transport: str,
                     consumer: str | None = None, consumer_rows: int | None = None,
                     received_at: float = 0.0) -> list[HandleWire | None]:
        """Each image's handle (None: ``consumer`` holds it); `RuntimeError` if the forward
        failed, `EncoderCoreDead` if the core is gone. ``received_at``: the `time.monotonic()`
        its HTTP request arrived at (the core's request times; 0: not a request's)."""
        job_id = next(self._ids)
        done = await self._call(job_id, EncodeJob(
            job_id, transport, images, consumer, consumer_rows, time.monotonic(), received_at))
        if done.error is not None:
            raise RuntimeError(f"the encoder failed: {done.error}")
        return done.handles

    async def stats(self) -> dict[str, Any]:
        call_id = next(self._ids)
        return (await self._call(call_id, StatsCall(call_id))).stats

    async def _call(self, key: int, msg: Any) -> Any:
        if self.dead is not None:
            raise self.dead
        fut = asyncio.get_running_loop().create_future()
        self._waiting[key] = fut
        try:
            await self._sock.send(self._enc.encode(msg), copy=False)
            return await fut
        finally:
            self._waiting.pop(key, None)

    async def _receive(self) -> None:
        while True:
            msg = self._dec.decode(await self._sock.recv())
            fut = self._waiting.get(msg.job_id if isinstance(msg, JobDone) else msg.call_id)
            if fut is not None and not fut.done():  # else its client left
                fut.set_result(msg)

    async def _watch(self) -> None:
        while pid_alive(self.pid):
            await asyncio.sleep(WATCH_S)
        self.dead = EncoderCoreDead("the encoder core process is gone")
        logger.error("%s", self.dead)
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(self.dead)
        if self.on_dead is not None:
            self.on_dead(self.dead)

    async def close(self) -> None:
        if self.owns_core and self.dead is None and self._sock is not None:
            await self._sock.send(self._enc.encode(Stop()))
        for task in self._tasks:
            task.cancel()
        if self._sock is not None:
            self._sock.close(0)
            self._ctx.term()
