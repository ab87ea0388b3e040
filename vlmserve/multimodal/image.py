"""Image loading and validation: every user-supplied image goes through ``load_image``."""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from vlmserve.errors import InvalidImageError

ImageSource = Image.Image | bytes | bytearray | memoryview | str | os.PathLike
DEFAULT_MAX_REMOTE_BYTES = 32 << 20


def load_image(
    src: ImageSource,
    *,
    allowed_local_dir: str | None = None,
    max_pixels: int | None = None,
    allow_remote: bool = False,
    timeout: float = 10.0,
    max_remote_bytes: int = DEFAULT_MAX_REMOTE_BYTES,
) -> Image.Image:
    """Load, fully decode and validate an image; return it in RGB mode.

    ``src`` is a PIL image, encoded bytes, a ``data:image/...;base64,`` URL, a local path or
    ``file://`` URL (inside ``allowed_local_dir`` when given), or an http(s) URL (only with
    ``allow_remote``). Any problem raises ``InvalidImageError`` naming it.
    """
    if isinstance(src, Image.Image):
        image = src
        _check_size(image, max_pixels)
        try:
            image.load()
        except Exception as e:  # noqa: BLE001 - PIL raises many types on corrupt data
            raise InvalidImageError(f"could not decode image: {e}") from e
    else:
        image = _decode(
            _read_source(src, allowed_local_dir, allow_remote, timeout, max_remote_bytes),
            max_pixels,
        )
    return _to_rgb(image)


def _read_source(
    src: ImageSource,
    allowed_local_dir: str | None,
    allow_remote: bool,
    timeout: float,
    max_remote_bytes: int,
) -> bytes:
    if isinstance(src, (bytes, bytearray, memoryview)):
        return bytes(src)
    if isinstance(src, os.PathLike):
        return _read_file(os.fspath(src), allowed_local_dir)
    if not isinstance(src, str):
        raise InvalidImageError(f"unsupported image source of type {type(src).__name__}")
    scheme = src.split(":", 1)[0].lower() if ":" in src else ""
    if scheme == "data":
        return _decode_data_url(src)
    if scheme in ("http", "https"):
        if not allow_remote:
            raise InvalidImageError("remote image URLs are not allowed")
        return _fetch(src, timeout, max_remote_bytes)
    if scheme == "file":
        parsed = urllib.parse.urlparse(src)
        if parsed.netloc not in ("", "localhost"):
            raise InvalidImageError(f"file URL with a remote host is not allowed: {src!r}")
        return _read_file(urllib.parse.unquote(parsed.path), allowed_local_dir)
    return _read_file(src, allowed_local_dir)


def _decode_data_url(url: str) -> bytes:
    header, sep, payload = url[len("data:") :].partition(",")
    if not sep:
        raise InvalidImageError("malformed data URL: no ',' before the payload")
    media_type, *params = header.split(";")
    if "base64" not in params:
        raise InvalidImageError("data URL must be base64-encoded (data:image/...;base64,...)")
    if media_type and not media_type.lower().startswith("image/"):
        raise InvalidImageError(f"data URL media type {media_type!r} is not an image")
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidImageError(f"invalid base64 in image data URL: {e}") from e


def _read_file(path: str, allowed_local_dir: str | None) -> bytes:
    real = Path(os.path.realpath(os.path.expanduser(path)))
    if allowed_local_dir is not None:
        root = Path(os.path.realpath(allowed_local_dir))
        if not real.is_relative_to(root):
            raise InvalidImageError(f"image path {path!r} is outside the allowed directory")
    if not real.is_file():
        raise InvalidImageError(f"image file not found: {path!r}")
    try:
        return real.read_bytes()
    except OSError as e:
        raise InvalidImageError(f"could not read image file {path!r}: {e}") from e


def _fetch(url: str, timeout: float, max_bytes: int) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - scheme checked
            data = resp.read(max_bytes + 1)
    except Exception as e:  # noqa: BLE001 - network errors come in many types
        raise InvalidImageError(f"could not fetch image {url!r}: {e}") from e
    if len(data) > max_bytes:
        raise InvalidImageError(f"remote image is larger than {max_bytes} bytes")
    return data


def _decode(data: bytes, max_pixels: int | None) -> Image.Image:
    if not data:
        raise InvalidImageError("image data is empty")
    try:
        image = Image.open(io.BytesIO(data))
        _check_size(image, max_pixels)  # from the header, before decoding the pixels
        image.load()
    except InvalidImageError:
        raise
    except Image.DecompressionBombError as e:
        raise InvalidImageError(f"image is too large to decode: {e}") from e
    except Exception as e:  # noqa: BLE001 - PIL raises many types on corrupt data
        raise InvalidImageError(f"could not decode image: {e}") from e
    return image


def _check_size(image: Image.Image, max_pixels: int | None) -> None:
    width, height = image.size
    if width <= 0 or height <= 0:
        raise InvalidImageError(f"image has zero size ({width}x{height})")
    if max_pixels is not None and width * height > max_pixels:
        raise InvalidImageError(
            f"image of {width}x{height} = {width * height} pixels exceeds the limit of "
            f"{max_pixels} pixels"
        )


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB copy of ``image``; transparent areas are composited onto white."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


@dataclass(frozen=True)
class RestrictedImageLoader:
    """`load_image` under a server's limits, for sources given as strings (data URLs, paths,
    ``file://`` and http(s) URLs). Picklable: it runs in the front end's preprocessing
    processes."""

    allowed_local_dir: str | None = None
    allow_remote: bool = False
    max_pixels: int | None = None
    timeout: float = 10.0
    max_remote_bytes: int = DEFAULT_MAX_REMOTE_BYTES

    def __call__(self, src: ImageSource) -> Image.Image:
        if not isinstance(src, str):
            raise InvalidImageError(f"an image must be given as a URL, got {type(src).__name__}")
        scheme = src.split(":", 1)[0].lower() if ":" in src[:16] else ""
        if scheme not in ("", "data", "file", "http", "https"):
            raise InvalidImageError(f"unsupported image URL scheme {scheme!r}")
        if scheme in ("", "file") and self.allowed_local_dir is None:
            raise InvalidImageError("local image paths are not allowed by this server "
                                    "(see --allowed-local-media-path)")
        return load_image(src, allowed_local_dir=self.allowed_local_dir,
                          allow_remote=self.allow_remote, max_pixels=self.max_pixels,
                          timeout=self.timeout, max_remote_bytes=self.max_remote_bytes)
