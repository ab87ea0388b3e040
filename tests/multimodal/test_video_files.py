"""Video files are untrusted input: whatever bytes a request sends, decoding gives frames or
an `InvalidImageError` naming the problem (no other exception, no crash), quickly; the
frames and the limits as documented."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine.helpers import make_mp4
from vlmserve.errors import InvalidImageError
from vlmserve.multimodal.video import decode_video

CLIP = make_mp4(count=8, width=32, height=32, fps=4)


def _decoded_or_refused(data: bytes) -> None:
    try:
        video = decode_video(data, num_frames=4, max_pixels=1 << 20, max_total_pixels=1 << 22)
    except InvalidImageError:
        pass
    else:
        assert video.frames.dtype == np.uint8 and video.frames.ndim == 4
        assert 1 <= video.num_frames <= 4 and video.frames.shape[-1] == 3


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(CLIP) - 1), st.integers(0, 255)),
                min_size=1, max_size=40))
def test_corrupted_files_decode_or_are_refused(edits) -> None:
    data = bytearray(CLIP)
    for at, value in edits:
        data[at] = value
    _decoded_or_refused(bytes(data))


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.integers(0, len(CLIP)), st.binary(max_size=256))
def test_truncated_or_foreign_bytes_decode_or_are_refused(cut, junk) -> None:
    _decoded_or_refused(CLIP[:cut])
    _decoded_or_refused(junk)
    _decoded_or_refused(CLIP[:cut] + junk)


def test_the_clip_itself_decodes() -> None:
    video = decode_video(CLIP, num_frames=4)
    assert video.frames.shape == (4, 32, 32, 3) and video.fps == 2.0
