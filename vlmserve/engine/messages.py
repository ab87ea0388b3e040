"""What crosses between the server's front ends and the engine-core process.

Typed msgspec structs, one per message kind, encoded as msgpack. Tensors (an image's uint8
pixels, prompt positions) do not go through msgpack: each becomes a frame of its own in the
same zmq multipart message, sent and received without a copy, and the msgpack body holds
only its dtype, shape and frame index.

    front end -> core: Hello, AddRequest, Abort, Utility, Shutdown
    core -> front end: Ready (once, after Hello), StepOutputs (once a step with this front
                       end's tokens), UtilityResult, RequestFailed
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from typing import Any

import msgspec
import numpy as np
import torch

from vlmserve.sampling_params import SamplingParams
from vlmserve.transfer.wire import HandleWire

# decoded tensors share their frames' memory, read-only when a frame is `bytes` (a front end
# decoding its own message: `preprocess.send_to_encoders`); they are read, never written
warnings.filterwarnings("ignore", message="The given NumPy array is not writable",
                        category=UserWarning, module=__name__)

_TENSOR_EXT = 1


class ImageData(msgspec.Struct, array_like=True):
    """One image of a request: scheduling metadata and its uint8 pixels (a frame)."""

    mm_hash: str
    offset: int
    length: int
    encoder_meta: tuple[int, ...]
    pixels: Any  # torch.Tensor [H, W, 3] uint8
    embeds: Any = None  # torch.Tensor [length, hidden]: encoded elsewhere (pixels empty)
    # or its rows held by an encoder server, for the core to open (pixels empty)
    handle: HandleWire | None = None


class Hello(msgspec.Struct, tag=True, array_like=True):
    pass


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    images: list[ImageData]
    prompt_positions: Any  # torch.Tensor [rows, num_prompt_tokens] int64, or None
    position_offset: int
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]
    stopped: bool = False  # a stop string ended them (not the client leaving)


class Utility(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    method: str  # "get_stats"


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class Ready(msgspec.Struct, tag=True, array_like=True):
    model_path: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    limits: dict[str, Any]  # AdmissionLimits fields
    pid: int


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    """One step's new tokens for one front end, as parallel lists (a token per request);
    log-probabilities only for the requests that asked (`SamplingParams.logprobs`)."""

    request_ids: list[str]
    token_ids: list[int]
    finish_reasons: list[str | None]  # "stop", "length", or None while running
    step_time: float  # host seconds of the core's loop iteration that produced them
    num_running: int
    num_waiting: int
    # {request id: {token id: logprob}} of the step's token; None while no request asked
    logprobs: dict[str, dict[int, float]] | None = None
    # {request id: (per prompt token {token id: logprob} or None, ranks)}, once per request
    # that asked (`prompt_logprobs`), with its first token
    prompt_logprobs: dict[str, tuple[list[dict[int, float] | None], list[int | None]]] | None = (
        None)

    def add_logprobs(self, req: Any) -> None:
        """The logprobs of the token just appended for `req` (a `Request`), if it asked, and
        its prompt's the first time."""
        if req.output_logprobs is not None:
            if self.logprobs is None:
                self.logprobs = {}
            self.logprobs[req.request_id] = req.output_logprobs[-1]
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            req.prompt_logprobs_sent = True
            if self.prompt_logprobs is None:
                self.prompt_logprobs = {}
            self.prompt_logprobs[req.request_id] = (req.prompt_logprobs,
                                                    req.prompt_logprob_ranks)


class UtilityResult(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    result: Any = None
    error: str | None = None


class RequestFailed(msgspec.Struct, tag=True, array_like=True):
    """A request ends without output: the core refused it (its limits raced a change, or an
    id in use: the client's fault) or, with `in_step`, a step that ran it failed (the
    server's: the reason is in the core's log)."""

    request_id: str
    message: str
    in_step: bool = False


ToCore = Hello | AddRequest | Abort | Utility | Shutdown
FromCore = Ready | StepOutputs | UtilityResult | RequestFailed


class Encoder:
    """Message -> zmq frames: the msgpack body first, then one frame per tensor. Safe to
    share between threads."""

    def __init__(self) -> None:
        self._local = threading.local()  # the frames of the message being encoded, per thread
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)

    def encode(self, msg: msgspec.Struct) -> list[Any]:
        self._local.frames = frames = [b""]
        try:
            frames[0] = self._encoder.encode(msg)
        finally:
            self._local.frames = None
        return frames

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            frames = self._local.frames
            t = obj.detach().cpu().contiguous()
            bf16 = t.dtype == torch.bfloat16  # numpy has no bfloat16: its bits as int16
            arr = (t.view(torch.int16) if bf16 else t).numpy()
            frames.append(memoryview(arr).cast("B") if arr.size else b"")
            meta = ("bfloat16" if bf16 else str(arr.dtype), list(arr.shape), len(frames) - 1)
            return msgspec.msgpack.Ext(_TENSOR_EXT, msgspec.msgpack.encode(meta))
        raise NotImplementedError(f"cannot send {type(obj)} to the engine core")


class Decoder:
    """zmq frames -> message; tensors share the frames' memory (no copy)."""

    def __init__(self, kind: Any) -> None:
        self._frames: list[Any] = []
        self._decoder = msgspec.msgpack.Decoder(kind, ext_hook=self._ext_hook)

    def decode(self, frames: list[Any]) -> Any:
        self._frames = frames
        try:
            return self._decoder.decode(frames[0])
        finally:
            self._frames = []

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        assert code == _TENSOR_EXT, code
        dtype, shape, index = msgspec.msgpack.decode(data)
        frame = self._frames[index]
        buf = frame.buffer if hasattr(frame, "buffer") else frame
        if dtype == "bfloat16":
            return torch.from_numpy(np.frombuffer(buf, dtype=np.int16).reshape(shape)).view(
                torch.bfloat16)
        return torch.from_numpy(np.frombuffer(buf, dtype=dtype).reshape(shape))


_raw_add = msgspec.msgpack.Decoder(AddRequest, ext_hook=lambda code, data: msgspec.msgpack.Ext(
    code, bytes(data)))  # tensors left as they are on the wire (references to frames)
_raw_encoder = msgspec.msgpack.Encoder()


def relabeled(frames: list[Any], request_id: str, seed: int | None) -> list[Any] | None:
    """The frames of an `AddRequest` as another request of the same prompt and parameters
    but its own id and seed, sharing its tensor frames; None if it holds embedding handles
    (each opens once)."""
    msg = _raw_add.decode(frames[0])
    if any(img.handle is not None for img in msg.images):
        return None
    params = dataclasses.replace(msg.sampling_params, seed=seed)
    return [_raw_encoder.encode(msgspec.structs.replace(
        msg, request_id=request_id, sampling_params=params)), *frames[1:]]
