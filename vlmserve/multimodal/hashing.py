"""Content hashes of images: the key of the multimodal embedding cache and of mm-aware prefixes."""

from __future__ import annotations

import hashlib

import numpy as np
from PIL import Image


def hash_image(image: Image.Image | np.ndarray, extra: str = "") -> str:
    """Hex sha256 of the image's mode, size, palette and pixel bytes, plus ``extra``.

    ``extra`` carries whatever else decides the embedding (model and processor settings), so
    equal pixels under different settings get different hashes. An ``[H, W, 3]`` uint8 array
    is an RGB image (same hash as the PIL image it came from), hashed without a copy.
    """
    h = hashlib.sha256()
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise ValueError(f"expected an [H, W, 3] uint8 array, got {image.shape} "
                             f"{image.dtype}")
        height, width = image.shape[:2]
        h.update(f"RGB\0{width}x{height}\0".encode())
        h.update(np.ascontiguousarray(image).data)
    else:
        width, height = image.size
        h.update(f"{image.mode}\0{width}x{height}\0".encode())
        palette = image.getpalette() if image.mode in ("P", "PA") else None
        if palette:
            h.update(bytes(palette))
        h.update(image.tobytes())
    h.update(b"\0" + extra.encode())
    return h.hexdigest()


def hash_video(frames: np.ndarray, extra: str = "") -> str:
    """Hex sha256 of a video's ``[T, H, W, 3]`` uint8 frames (their count and size too),
    plus ``extra``; never equal to an image's hash."""
    count, height, width = frames.shape[:3]
    h = hashlib.sha256(f"VIDEO\0{count}x{width}x{height}\0".encode())
    h.update(np.ascontiguousarray(frames).data)
    h.update(b"\0" + extra.encode())
    return h.hexdigest()
