"""The front end's cache of processed images: a prompt whose images were all seen (as data
URLs or fetched bytes) is not decoded, hashed or resized again and gives the same processed
prompt; one new image loads them all; paths are never cached; the request pixel limit holds
for cached images; the cache keeps to its byte budget."""

from __future__ import annotations

import base64
import io

import pytest
import torch

from tests.engine.helpers import make_image
from vlmserve.errors import InvalidImageError
from vlmserve.inputs.processor import InputProcessor
from vlmserve.models.qwen2_vl_processing import Qwen2VLInputProcessor
from vlmserve.multimodal.image import RestrictedImageLoader, load_image

PAD = "<|vision_start|><|image_pad|><|vision_end|>"


def _url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class _Counting:
    """A loader that counts the images it decodes."""

    def __init__(self, inner=load_image) -> None:
        self.inner, self.loaded = inner, 0

    def __call__(self, src):
        self.loaded += 1
        return self.inner(src)


def _prompt(*urls: str) -> dict:
    return {"prompt": f"user {PAD * len(urls)} what?", "multi_modal_data": {"image": list(urls)}}


@pytest.fixture
def procs(tiny_qwen2_vl_path):
    mp = Qwen2VLInputProcessor(tiny_qwen2_vl_path)
    return InputProcessor(mp, 10**6, image_cache_bytes=1 << 20), InputProcessor(mp, 10**6)


def _same(a, b) -> None:
    assert a.prompt_token_ids == b.prompt_token_ids and a.position_offset == b.position_offset
    assert torch.equal(a.prompt_positions, b.prompt_positions)
    for x, y in zip(a.images, b.images, strict=True):
        assert (x.mm_hash, x.offset, x.length, x.encoder_meta) == (y.mm_hash, y.offset, y.length,
                                                                y.encoder_meta)
        assert torch.equal(x.pixels, y.pixels)


def test_seen_images_are_not_processed_again(procs) -> None:
    cached, plain = procs
    a, b, c = (_url(make_image(w, h, i)) for i, (w, h) in enumerate([(56, 84), (112, 56),
                                                                     (84, 84)]))
    load = _Counting()
    first = cached.process(_prompt(a, b), load)
    assert load.loaded == 2
    again = cached.process(_prompt(b, a, b), load)  # same images, other order, one repeated
    assert load.loaded == 2 and cached.image_cache.hits == 1
    _same(again, plain.process(_prompt(b, a, b)))
    _same(first, plain.process(_prompt(a, b)))
    cached.process(_prompt(a, c), load)  # a new image: all of them loaded
    assert load.loaded == 4
    cached.process(_prompt(c), load)
    assert load.loaded == 4


def test_paths_are_not_cached(procs, tmp_path) -> None:
    cached, _ = procs
    path = tmp_path / "x.png"
    make_image(56, 56, 1).save(path)
    load = _Counting()
    for _ in range(2):
        cached.process(_prompt(str(path)), load)
    assert load.loaded == 2


def test_request_pixel_limit_holds_for_cached_images(procs) -> None:
    cached, _ = procs
    a = _url(make_image(56, 56, 3))
    cached.process(_prompt(a, a))
    strict = RestrictedImageLoader(max_request_pixels=56 * 56 * 2)
    cached.process(_prompt(a, a), strict)
    with pytest.raises(InvalidImageError, match="max-request-pixels"):
        cached.process(_prompt(a, a, a), strict)


def test_cache_keeps_to_its_budget(tiny_qwen2_vl_path) -> None:
    mp = Qwen2VLInputProcessor(tiny_qwen2_vl_path)
    one = mp.prepare(make_image(56, 56, 0)).pixels.numel()
    proc = InputProcessor(mp, 10**6, image_cache_bytes=2 * one)
    urls = [_url(make_image(56, 56, i)) for i in range(3)]
    for u in urls:
        proc.process(_prompt(u))
    assert proc.image_cache.bytes == 2 * one and len(proc.image_cache._items) == 2
    load = _Counting()
    proc.process(_prompt(urls[0]), load)  # the least recently used went
    assert load.loaded == 1
