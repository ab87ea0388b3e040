"""The engine-core process: `EngineCore` and its step loop, nothing else on its interpreter.

Front ends (`frontend/async_llm.py`, any number) connect zmq DEALER sockets to this process's
ROUTER socket. Each says `Hello` and gets `Ready` (the model's limits); then it sends
preprocessed requests and aborts, and receives, once per step, one `StepOutputs` with the
tokens of its own requests. Messages are read between steps and while the device runs a
step (`EngineCore.step(while_waiting=...)`), so admission overlaps the device's work.

The process (its start, signals, socket and idle loop: process.py) ends on `Shutdown`, when
its parent dies (PR_SET_PDEATHSIG, and a check of the parent pid while idle) or on SIGTERM.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import zmq

from vlmserve.config import EngineConfig
from vlmserve.engine.core import EngineCore
from vlmserve.engine.messages import (
    Abort,
    AddRequest,
    Decoder,
    Encoder,
    Hello,
    Ready,
    RequestFailed,
    Shutdown,
    StepOutputs,
    ToCore,
    Utility,
    UtilityResult,
)
from vlmserve.multimodal.inputs import ImageInput, ProcessedPrompt
from vlmserve.process import run_core
from vlmserve.request import Request, RequestStatus
from vlmserve.transfer.handles import HandleError
from vlmserve.transfer.wire import open_handles
from vlmserve.utils import freeze_startup_heap

logger = logging.getLogger(__name__)


class EngineCoreProc:
    """One `EngineCore` behind the process's ROUTER socket (`run_core` runs the loop)."""

    def __init__(self, config: EngineConfig, sock: zmq.Socket) -> None:
        self.core = EngineCore(config, serving=True)
        freeze_startup_heap()
        self.transform = self.core.model_processor.pixel_transform
        self.sock = sock
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished front end raises, not drops
        self.encoder = Encoder()
        self.decoder = Decoder(ToCore)
        self.owner: dict[str, bytes] = {}  # request id -> the front end's identity
        self.stopping = False
        self.flush = False  # an abort left worker state to drop: step once more

    def busy(self) -> bool:
        return self.core.has_unfinished_requests() or self.flush

    def step(self) -> None:
        """Every waiting message, then a step of the engine if it has work."""
        while self._receive_one():
            pass
        if self.stopping or not self.busy():
            return
        self.flush = False
        start = time.monotonic()
        updated = self.core.step(self._receive_one)
        self._send_outputs(updated, time.monotonic() - start)

    # ---- messages in -----------------------------------------------------------------------

    def _receive_one(self) -> bool:
        """Handle one waiting message; False if none was waiting."""
        try:
            identity, *frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        msg = self.decoder.decode(frames)
        identity = identity.bytes
        if isinstance(msg, AddRequest):
            self._add(identity, msg)
        elif isinstance(msg, Abort):
            status = (RequestStatus.FINISHED_STOPPED if msg.stopped
                      else RequestStatus.FINISHED_ABORTED)
            for rid in msg.request_ids:
                self.owner.pop(rid, None)
                self.flush |= self.core.abort_request(rid, status)
        elif isinstance(msg, Utility):
            self._utility(identity, msg)
        elif isinstance(msg, Hello):
            info = self.core.info
            self._send(identity, Ready(info.model_path, info.max_model_len, info.eos_token_ids,
                                       info.limits.__dict__, os.getpid()))
        elif isinstance(msg, Shutdown):
            self.stopping = True
        return True

    def _add(self, identity: bytes, msg: AddRequest) -> None:
        try:
            embeds = open_handles(msg.images, self.core.executor.device)
        except HandleError as e:
            self._send(identity, RequestFailed(
                msg.request_id, f"an image's embeddings could not be read from the encoder "
                f"server ({e})"))
            return
        images = [ImageInput(img.mm_hash, img.offset, img.length, img.pixels,
                             tuple(img.encoder_meta), self.transform, rows)
                  for img, rows in zip(msg.images, embeds, strict=True)]
        prompt = ProcessedPrompt(None, msg.prompt_token_ids, images, msg.prompt_positions,
                                 msg.position_offset)
        req = Request(msg.request_id, prompt, msg.sampling_params, tuple(msg.eos_token_ids))
        try:
            self.core.add_request(req)
        except ValueError as e:  # limits are checked by the front end too: a rare race
            self._send(identity, RequestFailed(msg.request_id, str(e)))
            return
        self.owner[msg.request_id] = identity

    def _utility(self, identity: bytes, msg: Utility) -> None:
        methods = {"get_stats": self.core.get_stats,
                   "reset_prefix_cache": self.core.reset_prefix_cache}
        try:
            if msg.method not in methods:
                raise ValueError(f"unknown utility method {msg.method!r}")
            self._send(identity, UtilityResult(msg.call_id, methods[msg.method]()))
        except Exception as e:  # noqa: BLE001 - reported to the caller
            self._send(identity, UtilityResult(msg.call_id, error=repr(e)))

    # ---- messages out ----------------------------------------------------------------------

    def _send(self, identity: bytes, msg: Any) -> None:
        try:
            self.sock.send_multipart([identity, *self.encoder.encode(msg)], copy=False)
        except zmq.ZMQError as e:  # that front end is gone: its requests go
            if e.errno != zmq.EHOSTUNREACH:
                raise
            gone = [rid for rid, who in self.owner.items() if who == identity]
            logger.warning("front end gone; aborting its %d requests", len(gone))
            for rid in gone:
                del self.owner[rid]
                self.flush |= self.core.abort_request(rid)

    def _send_outputs(self, updated: list[Request], step_time: float) -> None:
        by_client: dict[bytes, StepOutputs] = {}
        sched = self.core.scheduler
        running, waiting = len(sched.running), len(sched.waiting)
        for req in updated:
            identity = self.owner.get(req.request_id)
            if identity is None:  # aborted meanwhile
                continue
            if req.status is RequestStatus.FINISHED_ERROR:
                del self.owner[req.request_id]
                self._send(identity, RequestFailed(req.request_id, req.error, False)
                           if req.refused else RequestFailed(
                    req.request_id, f"the request failed in the engine ({req.error})", True))
                continue
            out = by_client.get(identity)
            if out is None:
                out = by_client[identity] = StepOutputs([], [], [], step_time, running, waiting)
            out.request_ids.append(req.request_id)
            out.token_ids.append(req.output_token_ids[-1])
            out.add_logprobs(req)
            finished = req.status.finished
            out.finish_reasons.append(req.status.value if finished else None)
            if finished:
                del self.owner[req.request_id]
        for identity, out in by_client.items():
            self._send(identity, out)

    def close(self) -> None:
        self.core.shutdown()


def run_engine_core(address: str, parent_pid: int, config: EngineConfig,
                    log_level: str = "info") -> None:
    """The engine-core process's entry point (`start_engine_core` spawns it by name)."""
    run_core(lambda sock: EngineCoreProc(config, sock), address, parent_pid, "engine core",
             config.model_config.device, log_level)
