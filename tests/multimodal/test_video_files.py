"""Video files are untrusted input: whatever bytes a request sends, decoding gives frames or
an `InvalidImageError` naming the problem (no other exception, no crash), quickly; the
frames and the limits as documented."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import zlib
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine.helpers import make_mp4
from vlmserve.errors import InvalidImageError
from vlmserve.multimodal.image import RestrictedImageLoader
from vlmserve.multimodal.video import decode_video

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def _png(width: int, height: int) -> bytes:
    """A 16-bit RGBA PNG of zeros (8 bytes a pixel once decoded), compressed row by row."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body)))

    z, row = zlib.compressobj(9), bytes(1 + width * 8)
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 16,
                                                             6, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def _png_video(fmt: str, declared: int, frame: bytes, codec: str = "png") -> bytes:
    """A two-frame file of `fmt` whose header declares `declared` x `declared` frames of
    16-bit RGBA, each packet the encoded `frame` (whatever size that one is)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=1)
        stream.width, stream.height, stream.pix_fmt = declared, declared, "rgba64be"
        for i in range(2):
            packet = av.Packet(frame)
            packet.stream, packet.pts, packet.dts = stream, i, i
            packet.time_base = Fraction(1, 1)
            out.mux(packet)
    return buf.getvalue()


PROBE = """
import json, sys
import av, numpy
from vlmserve.multimodal.image import RestrictedImageLoader

def peak_kib():  # this process's peak RSS (ru_maxrss would count the parent's before exec)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

loader = RestrictedImageLoader(max_pixels=1 << 20, max_image_bytes=8 << 20)
before, errors = peak_kib(), []
for path in sys.argv[1:]:
    try:
        loader.load_video(open(path, "rb").read())
        errors.append(None)
    except ValueError as e:
        errors.append(str(e))
grown = peak_kib() - before
print(json.dumps({"errors": errors, "grown_kib": grown}))
"""


def test_a_huge_frame_is_refused_before_it_is_decoded(tmp_path) -> None:
    """Small files (130 KB) whose one frame decodes to 4000x4000 16-bit RGBA (128 MB): in
    NUT, AVI and MP4, the header declaring that size, or declaring 64x64 (the frame lies):
    each refused naming the pixel limit, and the process's peak RSS grows by less than 16 MB
    over all of them (PyAV's probe decoded the first frame before the header check: +143 MB)."""
    big = _png(4000, 4000)
    paths = []
    for fmt, declared in (("nut", 4000), ("avi", 4000), ("mov", 4000), ("nut", 64)):
        path = tmp_path / f"{fmt}{declared}"
        path.write_bytes(_png_video(fmt, declared, big))
        paths.append(str(path))
    out = subprocess.run([sys.executable, "-c", PROBE, *paths], capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": ROOT})
    result = json.loads(out.stdout.splitlines()[-1])
    declared = "video frames of 4000x4000 = 16000000 pixels exceed the limit of 1048576 pixels"
    assert result["grown_kib"] < 16 << 10, result
    assert [e and declared in e for e in result["errors"][:3]] == [True] * 3, result
    assert "first frame does not decode within the limit of 1048576 pixels" in result["errors"][3]
    assert all("(--max-image-pixels)" in e for e in result["errors"])


def test_frames_over_the_decoded_byte_limit_and_foreign_containers_are_refused() -> None:
    """A frame's decoded bytes (its pixel format's, 16-bit RGBA: 8 a pixel) against
    --max-image-bytes, before the frames are decoded; a container that declares no streams
    in a header (MPEG-TS) is refused by name."""
    clip = _png_video("nut", 64, _png(64, 64))
    assert decode_video(clip).frames.shape == (2, 64, 64, 3)
    loader = RestrictedImageLoader(max_image_bytes=30_000)
    with pytest.raises(InvalidImageError, match=r"64x64 in rgba64be are 32768 bytes once "
                                                r"decoded, .* 30000 \(--max-image-bytes\)"):
        loader.load_video(clip)
    assert RestrictedImageLoader(max_image_bytes=32768).load_video(clip).num_frames == 2
    with pytest.raises(InvalidImageError, match="not a video container this server reads"):
        decode_video(_mpegts())


def _mpegts() -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mpegts") as out:
        stream = out.add_stream("mpeg2video", rate=4)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(4):
            frame = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")
            frame.pts = i
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()
