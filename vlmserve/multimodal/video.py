"""Video inputs: the frames a request gives (already sampled, as vLLM's and transformers'
``videos`` take them), checked and held as one uint8 array, with the frame rate they were
sampled at when the request says it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from vlmserve.errors import InvalidRequestError

MAX_FRAMES = 768  # transformers' Qwen2-VL video processor's max_frames


@dataclass(frozen=True)
class Video:
    """``frames`` [T, H, W, 3] uint8 RGB; ``fps``: frames per second as sampled (None: not
    given)."""

    frames: np.ndarray
    fps: float | None = None

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
