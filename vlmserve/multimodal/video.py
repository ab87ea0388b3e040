"""Video inputs: the frames a request gives (already sampled, as vLLM's and transformers'
``videos`` take them), checked and held as one uint8 array, with the frame rate they were
sampled at when the request says it; or an encoded video file (bytes, a data URL, a path),
decoded with PyAV into ``num_frames`` frames sampled evenly over it (vLLM's default: 32)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from vlmserve.errors import InvalidImageError, InvalidRequestError

MAX_FRAMES = 768  # transformers' Qwen2-VL video processor's max_frames
NUM_FRAMES = 32  # frames sampled from a video file (vLLM's default)
DECODE_TIMEOUT_S = 60.0  # the longest a video file may take to decode
MAX_SOURCE_FRAMES = 100_000  # a file holding more is refused before decoding it


@dataclass(frozen=True)
class Video:
    """``frames`` [T, H, W, 3] uint8 RGB; ``fps``: frames per second as sampled (None: not
    given); ``timestamps``: each frame's time in its source, in seconds, where known (a
    decoded file's; else frame i sits at i / fps)."""

    frames: np.ndarray
    fps: float | None = None
    timestamps: tuple[float, ...] | None = None

    @property
    def num_frames(self) -> int:
        return self.frames.shape[0]


def _frame(f: Any, i: int) -> np.ndarray:
    if isinstance(f, Image.Image):
        return np.asarray(f if f.mode == "RGB" else f.convert("RGB"))
    a = _array(f)
    if a.ndim != 3 or a.shape[-1] != 3:
        raise InvalidRequestError(f"video frame {i}: expected an RGB image [H, W, 3], got "
                                  f"shape {tuple(a.shape)}")
    return a


def _array(x: Any) -> np.ndarray:
    if hasattr(x, "detach") and hasattr(x, "numpy"):  # a torch tensor
        x = x.detach().cpu().numpy()
    if not isinstance(x, np.ndarray):
        raise InvalidRequestError(f"a video is an array [frames, H, W, 3], a list of frames "
                                  f"(PIL images or arrays), or (frames, {{'fps': ...}}); got "
                                  f"{type(x).__name__}")
    if x.dtype != np.uint8:
        raise InvalidRequestError(f"video pixels must be uint8 (0-255), got {x.dtype}")
    return x


def as_video(src: Any) -> Video:
    """A request's video: an array (numpy or torch) ``[T, H, W, 3]`` uint8, a list of frames
    (PIL images or ``[H, W, 3]`` arrays, all one size), or ``(frames, metadata)`` where
    metadata may give ``fps`` (a `Video` passes as it is). Raises `InvalidRequestError`
    naming what is wrong."""
    if isinstance(src, Video):
        return src
    fps = None
    if isinstance(src, tuple) and len(src) == 2 and isinstance(src[1], dict):
        src, meta = src
        unknown = set(meta) - {"fps"}
        if unknown:
            raise InvalidRequestError(f"video metadata: unknown key(s) {sorted(unknown)}; "
                                      "only 'fps' is read")
        fps = meta.get("fps")
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float))
                                or not 0 < fps < 1e6):
            raise InvalidRequestError(f"video metadata: fps must be a positive number, got "
                                      f"{fps!r}")
    if isinstance(src, (list, tuple)):
        if not src:
            raise InvalidRequestError("a video needs at least one frame")
        if len(src) > MAX_FRAMES:
            raise InvalidRequestError(f"a video has at most {MAX_FRAMES} frames, got "
                                      f"{len(src)}")
        frames = [_frame(f, i) for i, f in enumerate(src)]
        sizes = {f.shape for f in frames}
        if len(sizes) > 1:
            raise InvalidRequestError(f"video frames differ in size: {sorted(sizes)}")
        array = np.stack(frames)
    else:
        array = _array(src)
        if array.ndim != 4 or array.shape[-1] != 3:
            raise InvalidRequestError(f"a video array is [frames, H, W, 3], got shape "
                                      f"{tuple(array.shape)}")
        if not 0 < array.shape[0] <= MAX_FRAMES:
            raise InvalidRequestError(f"a video has 1 to {MAX_FRAMES} frames, got "
                                      f"{array.shape[0]}")
    if 0 in array.shape[1:3]:
        raise InvalidRequestError(f"video frames of {array.shape[2]}x{array.shape[1]} pixels")
    return Video(np.ascontiguousarray(array), None if fps is None else float(fps))


def decode_video(data: bytes, num_frames: int = NUM_FRAMES, max_pixels: int | None = None,
                 max_total_pixels: int | None = None, timeout_s: float = DECODE_TIMEOUT_S
                 ) -> Video:
    """An encoded video file's first video stream as ``num_frames`` frames (at most
    `MAX_FRAMES`) sampled evenly over it (all of them if it has fewer), with the rate they
    were sampled at (frames kept / the stream's duration). Raises `InvalidImageError` for
    anything PyAV cannot decode, no video stream, frames over ``max_pixels``, frames kept
    over ``max_total_pixels`` in all (both checked before any frame is decoded), frames
    that change size, more than `MAX_SOURCE_FRAMES` frames, or decoding past ``timeout_s``
    (a long, large file must not hold a preprocessing process for minutes)."""
    import io

    try:
        import av
    except ImportError:  # pragma: no cover - av comes with the serve extra
        raise InvalidImageError("video files need PyAV (pip install av)") from None
    try:
        with av.open(io.BytesIO(data)) as container:
            streams = container.streams.video
            if not streams:
                raise InvalidImageError("the file has no video stream")
            stream = streams[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            if max_pixels is not None and width * height > max_pixels:
                raise InvalidImageError(f"video frames of {width}x{height} = {width * height} "
                                        f"pixels exceed the limit of {max_pixels}")
            total = sum(1 for packet in container.demux(stream) if packet.size)
        if not 0 < total <= MAX_SOURCE_FRAMES:
            raise InvalidImageError(f"the video has {total} frames (1 to {MAX_SOURCE_FRAMES})")
        count = min(num_frames, total, MAX_FRAMES)
        keep = sorted({int(i) for i in np.linspace(0, total - 1, count)})
        if max_total_pixels is not None and len(keep) * width * height > max_total_pixels:
            raise InvalidImageError(
                f"{len(keep)} frames of {width}x{height} hold {len(keep) * width * height} "
                f"pixels, which exceeds the limit of {max_total_pixels}")
        frames, wanted = [], iter(keep)
        nxt = next(wanted)
        deadline = time.monotonic() + timeout_s
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            rate = float(stream.average_rate or 0)
            for i, frame in enumerate(container.decode(stream)):
                if time.monotonic() > deadline:
                    raise InvalidImageError(f"decoding the video took over {timeout_s:g} s")
                if (frame.width, frame.height) != (width, height):
                    raise InvalidImageError(f"frame {i} of the video is {frame.width}x"
                                            f"{frame.height}, the stream {width}x{height}")
                if i == nxt:
                    frames.append(frame.to_ndarray(format="rgb24"))
                    nxt = next(wanted, None)
                    if nxt is None:
                        break
    except InvalidImageError:
        raise
    except Exception as e:  # noqa: BLE001 - PyAV's errors for broken or foreign files
        raise InvalidImageError(f"cannot decode the video: {type(e).__name__}: {e}") from None
    if not frames:
        raise InvalidImageError("no frame of the video could be decoded")
    fps = len(frames) / (total / rate) if rate > 0 else None
    times = tuple(i / rate for i in keep[:len(frames)]) if rate > 0 else None
    return Video(np.stack(frames), fps, times)


def load_video(src: Any, num_frames: int = NUM_FRAMES) -> Video:
    """The Python API's video: frames as `as_video` takes them, or a video file (bytes, a
    data URL, a local path or ``file://`` URL) decoded by `decode_video`."""
    if isinstance(src, (bytes, bytearray, memoryview, str)):
        from vlmserve.multimodal.image import _read_source

        return decode_video(_read_source(src, None, allow_remote=False, kind="video"),
                            num_frames)
    return as_video(src)
