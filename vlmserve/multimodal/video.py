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


# container formats accepted, by their file's first bytes: each declares its streams (size,
# codec) in a header, so the streams are known before PyAV's probe decodes anything, and the
# decoder's own pixel limit (max_pixels, a codec option) reaches them; a format whose streams
# appear only while probing (MPEG-TS/PS, FLV, raw streams) is refused, and so is every other
# demuxer (playlists and the like, which name further files)
CONTAINERS = {"mov": "MP4/MOV", "matroska": "WebM/MKV", "avi": "AVI", "nut": "NUT",
              "ogg": "Ogg"}
_MOV_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide")


def container_format(data: bytes) -> str | None:
    """The demuxer (a key of `CONTAINERS`) for a video file's first bytes, or None."""
    if data[4:8] in _MOV_BOXES:
        return "mov"
    if data[:4] == b"\x1aE\xdf\xa3":
        return "matroska"
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "avi"
    if data[:24] == b"nut/multimedia container":
        return "nut"
    if data[:4] == b"OggS":
        return "ogg"
    return None


def frame_bytes(pix_fmt: str, width: int, height: int) -> int:
    """Bytes of one decoded ``width`` x ``height`` frame of FFmpeg's ``pix_fmt`` (all its
    planes: yuv420p 1.5 a pixel, rgb24 3, 16-bit RGBA 8)."""
    import av

    return sum((c.bits + 7) // 8 * c.width * c.height
               for c in av.VideoFormat(pix_fmt, width, height).components)


def decode_video(data: bytes, num_frames: int = NUM_FRAMES, max_pixels: int | None = None,
                 max_total_pixels: int | None = None, timeout_s: float = DECODE_TIMEOUT_S,
                 max_frame_bytes: int | None = None) -> Video:
    """An encoded video file's first video stream as ``num_frames`` frames (at most
    `MAX_FRAMES`) sampled evenly over it (all of them if it has fewer), with the rate they
    were sampled at (frames kept / the stream's duration). Raises `InvalidImageError` for
    anything PyAV cannot decode, a container not in `CONTAINERS`, no video stream, frames
    over ``max_pixels`` or (decoded, in their pixel format) ``max_frame_bytes``, frames kept
    over ``max_total_pixels`` in all, frames that change size, more than `MAX_SOURCE_FRAMES`
    frames, or decoding past ``timeout_s`` (a long, large file must not hold a preprocessing
    process for minutes).

    Nothing over a limit is decoded: the file's header is read with every decoder barred
    (its size, the packets counted), and FFmpeg's decoders are given ``max_pixels`` as their
    own limit, so that the probe PyAV runs on opening a file (it decodes a first frame where
    the header leaves the pixel format open) refuses a larger frame before allocating it. A
    refused file costs at most one frame within ``max_pixels`` (in its pixel format: at most
    8 bytes a pixel for 16-bit RGBA)."""
    import io

    try:
        import av
    except ImportError:  # pragma: no cover - av comes with the serve extra
        raise InvalidImageError("video files need PyAV (pip install av)") from None
    fmt = container_format(data)
    if fmt is None:
        raise InvalidImageError(
            f"not a video container this server reads ({', '.join(CONTAINERS.values())}: "
            "formats that declare their streams in a header)")
    limit = {} if max_pixels is None else {"max_pixels": str(max_pixels)}
    try:
        with av.open(io.BytesIO(data), format=fmt,  # the header: no decoder may open
                     options={"codec_whitelist": "none"}) as container:
            streams = container.streams.video
            if not streams:
                raise InvalidImageError("the file has no video stream")
            stream = streams[0]
            _check_frame(stream.codec_context.width, stream.codec_context.height,
                         max_pixels)
            total = sum(1 for packet in container.demux(stream) if packet.size)
        if not 0 < total <= MAX_SOURCE_FRAMES:
            raise InvalidImageError(f"the video has {total} frames (1 to {MAX_SOURCE_FRAMES})")
        count = min(num_frames, total, MAX_FRAMES)
        keep = sorted({int(i) for i in np.linspace(0, total - 1, count)})
        frames, wanted = [], iter(keep)
        nxt = next(wanted)
        deadline = time.monotonic() + timeout_s
        with av.open(io.BytesIO(data), format=fmt, options=limit) as container:
            stream = container.streams.video[0]
            context = stream.codec_context
            width, height = context.width, context.height
            if width <= 0 or height <= 0:
                raise InvalidImageError(
                    "the size of the video's frames cannot be read" if max_pixels is None
                    else f"the video's first frame does not decode within the limit of "
                    f"{max_pixels} pixels a frame (--max-image-pixels): larger, or broken")
            _check_frame(width, height, max_pixels)
            size = frame_bytes(context.pix_fmt, width, height) if context.pix_fmt else 0
            if max_frame_bytes is not None and size > max_frame_bytes:
                raise InvalidImageError(
                    f"video frames of {width}x{height} in {context.pix_fmt} are {size} bytes "
                    f"once decoded, which exceeds the limit of {max_frame_bytes} "
                    "(--max-image-bytes)")
            if max_total_pixels is not None and len(keep) * width * height > max_total_pixels:
                raise InvalidImageError(
                    f"{len(keep)} frames of {width}x{height} hold {len(keep) * width * height} "
                    f"pixels, which exceeds the limit of {max_total_pixels}")
            context.options = {**context.options, **limit}  # frames that grow mid-stream
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


def _check_frame(width: int, height: int, max_pixels: int | None) -> None:
    """A frame size (0: not known yet) against the pixel limit a frame."""
    if max_pixels is not None and width * height > max_pixels:
        raise InvalidImageError(f"video frames of {width}x{height} = {width * height} pixels "
                                f"exceed the limit of {max_pixels} pixels a frame "
                                "(--max-image-pixels)")


def load_video(src: Any, num_frames: int = NUM_FRAMES) -> Video:
    """The Python API's video: frames as `as_video` takes them, or a video file (bytes, a
    data URL, a local path or ``file://`` URL) decoded by `decode_video`."""
    if isinstance(src, (bytes, bytearray, memoryview, str)):
        from vlmserve.multimodal.image import _read_source

        return decode_video(_read_source(src, None, allow_remote=False, kind="video"),
                            num_frames)
    return as_video(src)
