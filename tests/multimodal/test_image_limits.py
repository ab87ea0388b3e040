"""A server's image limits, checked from the headers of all of a request's images before any
is decoded: pixels per image, decoded bytes per image (mode-aware), pixels per request; and
errors that name the image."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import pytest
from PIL import Image, ImageFile

from vlmserve.entrypoints.args import ServerConfig
from vlmserve.errors import InvalidImageError
from vlmserve.inputs.processor import _images_of
from vlmserve.multimodal.image import RestrictedImageLoader, decoded_bytes, load_image


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def solid_png(width: int, height: int, color_type: int = 2, bit_depth: int = 8,
              with_pixels: bool = True) -> bytes:
    """A one-colour (all zero) PNG written row by row, never held decoded; without pixels,
    only the header (enough for every check made before decoding)."""
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[color_type]
    idat = b""
    if with_pixels:
        row = b"\0" * (1 + width * channels * bit_depth // 8)
        comp = zlib.compressobj(9)
        idat = b"".join(comp.compress(row) for _ in range(height)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat)
            + _chunk(b"IEND", b""))


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def huge_png() -> bytes:
    data = solid_png(8000, 8000)
    assert len(data) < 400_000  # 64 M pixels in ~190 KB: the probe's image
    return data


@pytest.fixture
def decodes(monkeypatch) -> list:
    """Records every pixel decode (`ImageFile.load`)."""
    calls: list = []
    real = ImageFile.ImageFile.load

    def load(self):
        calls.append(self.size)
        return real(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    return calls


def server_loader(**kw) -> RestrictedImageLoader:
    cfg = ServerConfig(**kw)
    return RestrictedImageLoader(max_pixels=cfg.max_image_pixels,
                                 max_request_pixels=cfg.max_request_pixels,
                                 max_image_bytes=cfg.max_image_bytes)


def test_defaults_are_safe() -> None:
    cfg = ServerConfig()
    assert cfg.max_image_pixels == 8192 * 4096
    assert cfg.max_request_pixels == 8192 * 8192
    assert cfg.max_image_bytes == 3 * cfg.max_image_pixels  # an RGB image at the limit
    assert Image.MAX_IMAGE_PIXELS is not None  # Pillow's own guard stays on


def test_pixel_limit_from_the_header_before_decoding(huge_png: bytes, decodes: list) -> None:
    loader = server_loader()
    with pytest.raises(InvalidImageError) as e:
        loader.load_all([data_url(huge_png)])
    assert str(e.value) == ("image 1 is 8000x8000 = 64000000 pixels, which exceeds the limit "
                            "of 33554432 (--max-image-pixels)")
    assert decodes == []


def test_eight_huge_images_refused_fast(huge_png: bytes, decodes: list) -> None:
    """The probe: eight 8000x8000 PNGs took 4 GB and 15-30 s to decode; now refused from
    the first one's header, none decoded."""
    loader = server_loader()
    with pytest.raises(InvalidImageError, match="image 1 is 8000x8000"):
        _images_of({"multi_modal_data": {"image": [data_url(huge_png)] * 8}}, loader)
    assert decodes == []


def test_decoded_bytes_count_bands_and_bit_depth(decodes: list) -> None:
    assert decoded_bytes(Image.open(io.BytesIO(solid_png(100, 100, 2)))) == 30_000  # RGB
    assert decoded_bytes(Image.open(io.BytesIO(solid_png(100, 100, 6)))) == 40_000  # RGBA
    gray16 = Image.open(io.BytesIO(solid_png(100, 100, 0, 16)))
    assert decoded_bytes(gray16) == 20_000, gray16.mode  # 16-bit gray: 2 bytes a pixel
    assert decoded_bytes(Image.open(io.BytesIO(solid_png(100, 100, 0)))) == 10_000
    loader = RestrictedImageLoader(max_pixels=10_000, max_image_bytes=30_000)
    assert loader.load_all([solid_png(100, 100, 2)])[0].size == (100, 100)  # RGB fits
    decodes.clear()
    with pytest.raises(InvalidImageError) as e:  # the same pixels as RGBA do not
        loader.load_all([solid_png(100, 100, 6, with_pixels=False)])
    assert str(e.value) == ("image 1 is 100x100 in mode RGBA, 40000 bytes once decoded, which "
                            "exceeds the limit of 30000 (--max-image-bytes)")
    with pytest.raises(InvalidImageError, match="--max-image-bytes"):
        RestrictedImageLoader(max_image_bytes=15_000).load_all(
            [solid_png(100, 100, 0, 16, with_pixels=False)])
    assert decodes == []


def test_request_total_checked_before_any_image_is_decoded(decodes: list) -> None:
    loader = RestrictedImageLoader(max_pixels=10_000, max_request_pixels=25_000)
    small = data_url(solid_png(100, 100))
    assert len(loader.load_all([small, small])) == 2
    assert decodes == [(100, 100)] * 2  # the spy sees decodes
    decodes.clear()
    with pytest.raises(InvalidImageError) as e:
        loader.load_all([small, small, small])
    assert str(e.value) == ("the request's 3 images hold 30000 pixels in all, which exceeds "
                            "the limit of 25000 (--max-request-pixels)")
    assert decodes == []
    with pytest.raises(InvalidImageError, match="image 3 is 200x100 = 20000 pixels"):
        loader.load_all([small, small, data_url(solid_png(200, 100, with_pixels=False))])
    assert decodes == []


def test_pillow_guard_behind_ours() -> None:
    """Without our limits, Pillow's decompression-bomb check still refuses a 400 M pixel
    header, before decoding."""
    header_only = solid_png(20_000, 20_000, with_pixels=False)
    with pytest.raises(InvalidImageError, match="image 1 of the request is too large"):
        RestrictedImageLoader().load_all([header_only])


def test_undecodable_image_names_the_part() -> None:
    ok = data_url(png(Image.new("RGB", (8, 8))))
    loader = RestrictedImageLoader()
    for bad in [data_url(b"definitely not an image"), b"GIF89a-not-really"]:
        with pytest.raises(InvalidImageError) as e:
            loader.load_all([ok, bad])
        assert str(e.value) == ("could not decode image 2 of the request: not a known "
                                "image format")
        assert "BytesIO" not in str(e.value)
    truncated = png(Image.effect_noise((64, 64), 50))[:120]
    with pytest.raises(InvalidImageError, match="^could not decode image 1 of the request: "):
        loader.load_all([truncated])
    with pytest.raises(InvalidImageError, match="^image 2 of the request: invalid base64"):
        loader.load_all([ok, "data:image/png;base64,@@"])
    with pytest.raises(InvalidImageError) as e:  # the offline API's message
        load_image(b"definitely not an image")
    assert str(e.value) == "could not decode image: not a known image format"


def test_remote_urls_are_never_fetched_by_the_loader() -> None:
    with pytest.raises(InvalidImageError, match="remote image URLs are not allowed"):
        RestrictedImageLoader().load_all(["http://127.0.0.1:1/x.png"])


def test_request_pixels_are_one_budget_for_images_and_videos(vlmserve_cache,
                                                             monkeypatch) -> None:
    """`--max-request-pixels` holds a request's images and videos together: a video each
    within it, but not all of them, is refused before the one over it is decoded (each
    video was checked alone: 8 large videos were decoded before the request's 400)."""
    from tests.engine.helpers import make_mp4
    from vlmserve.inputs.processor import InputProcessor
    from vlmserve.models.metadata import load_model_processor
    from vlmserve.multimodal import video

    _, _, model_processor = load_model_processor("tiny-qwen2-vl")
    processor = InputProcessor(model_processor, 448)
    decoded = []
    real = video.decode_video

    def spy(data, num_frames, max_pixels=None, max_total_pixels=None, *a, **kw):
        decoded.append(max_total_pixels)
        return real(data, num_frames, max_pixels, max_total_pixels, *a, **kw)

    monkeypatch.setattr("vlmserve.multimodal.image.decode_video", spy)
    clip = data_url_of(make_mp4())  # 12 frames of 64x48: 36,864 pixels
    pads = "<|vision_start|><|video_pad|><|vision_end|>"
    loader = RestrictedImageLoader(max_request_pixels=50_000)
    one = processor.process({"prompt": pads + "x", "multi_modal_data": {"video": [clip]}},
                            loader)
    assert len(one.images) == 1
    with pytest.raises(InvalidImageError, match="--max-request-pixels"):
        processor.process({"prompt": pads * 2 + "x", "multi_modal_data": {
            "video": [clip, clip]}}, loader)
    assert decoded == [50_000, 50_000, 50_000 - 36_864]  # the second refused from its header
    image = data_url(solid_png(120, 120))  # 14,400 pixels: the video no longer fits
    with pytest.raises(InvalidImageError, match="--max-request-pixels"):
        processor.process({"prompt": "<|vision_start|><|image_pad|><|vision_end|>" + pads,
                           "multi_modal_data": {"image": [image], "video": [clip]}}, loader)


def data_url_of(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()
