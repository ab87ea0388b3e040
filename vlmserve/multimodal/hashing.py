"""Content hashes of images: the key of the multimodal embedding cache and of mm-aware prefixes."""

from __future__ import annotations

import hashlib

from PIL import Image


def hash_image(image: Image.Image, extra: str = "") -> str:
    """Hex sha256 of the image's mode, size, palette and pixel bytes, plus ``extra``.

    ``extra`` carries whatever else decides the embedding (model and processor settings), so
    equal pixels under different settings get different hashes.
    """
    h = hashlib.sha256()
    width, height = image.size
    h.update(f"{image.mode}\0{width}x{height}\0".encode())
    palette = image.getpalette() if image.mode in ("P", "PA") else None
    if palette:
        h.update(bytes(palette))
    h.update(image.tobytes())
    h.update(b"\0" + extra.encode())
    return h.hexdigest()
