"""The online benchmarks' HTTP client: streamed chat completions over aiohttp, each request's
body serialized before its clock starts and the SSE lines read as bytes.

The client must not be what it measures. Through the `openai` SDK (httpx, a pydantic model
per chunk) one process fell behind a fake server that sends every open stream a token each
3 ms: at 192 streams it reported 16.9 ms per token and 404 ms p99 gaps for a server whose own
gaps were 7.2 and 101 ms, and tokens arrived in bursts (median gap 0.09 ms). This client
stays within 3% of the server's own pacing there (`benchmarks/client_fidelity.py`,
`docs/benchmarks.md`).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np


def image_data_url(side: int, rng: np.random.Generator) -> str:
    """A random square RGB image as a PNG data URL (noise: PNG cannot shrink it)."""
    from PIL import Image

    img = Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def encode_mp4(frames: np.ndarray, fps: int) -> bytes:
    """``frames`` [T, H, W, 3] uint8 as an MPEG-4 file (PyAV; H and W even)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for f in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def video_data_url(frames: int, side: int, rng: np.random.Generator, fps: int = 2) -> str:
    """A random square video of ``frames`` frames as an MP4 data URL (a `video_url`)."""
    clip = encode_mp4(rng.integers(0, 256, (frames, side, side, 3), dtype=np.uint8), fps)
    return "data:video/mp4;base64," + base64.b64encode(clip).decode()


def open_session(base_url: str) -> aiohttp.ClientSession:
    """One connection pool for a run; the caller bounds concurrency, the pool does not."""
    return aiohttp.ClientSession(
        base_url=base_url.rstrip("/"),
        timeout=aiohttp.ClientTimeout(total=None, connect=30, sock_read=600),
        connector=aiohttp.TCPConnector(limit=0))


async def first_model(session: aiohttp.ClientSession) -> str:
    async with session.get("/v1/models") as r:
        r.raise_for_status()
        return (await r.json())["data"][0]["id"]


def chat_body(model: str, messages: list[dict], max_tokens: int,
              extra: dict | None = None) -> bytes:
    """A streamed greedy chat request of exactly `max_tokens` tokens (`ignore_eos`), usage in
    its last chunk; ``extra``: more fields (e.g. a response_format), over these."""
    return json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}, **(extra or {})}).encode()


@dataclass
class StreamResult:
    start: float  # perf_counter when the request was sent
    ttft: float | None = None  # seconds to the first chunk with content
    stamps: list[float] = field(default_factory=list)  # arrival of each chunk with content
    text: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    e2e: float = 0.0

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


async def stream_chat(session: aiohttp.ClientSession, body: bytes) -> StreamResult:
    """POST one serialized chat request and read its stream. A chunk counts as a token
    chunk when its delta has content, even "" (random weights sample ids that decode to no
    text yet); failures are recorded in `error`, never raised."""
    res = StreamResult(start=time.perf_counter())
    try:
        async with session.post("/v1/chat/completions", data=body,
                                headers={"Content-Type": "application/json"}) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:300]}"
            else:
                async for line in r.content:
                    now = time.perf_counter()
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        res.error = str(chunk["error"])
                        break
                    choices = chunk.get("choices")
                    if choices and choices[0]["delta"].get("content") is not None:
                        if res.ttft is None:
                            res.ttft = now - res.start
                        res.stamps.append(now)
                        res.text.append(choices[0]["delta"]["content"])
                    if chunk.get("usage"):
                        res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                        res.completion_tokens = chunk["usage"]["completion_tokens"]
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.e2e = time.perf_counter() - res.start
    return res


class LoopLag:
    """How late this event loop runs a timer of `interval` seconds while a run goes on: the
    client's own delay in reading what the server sent (a client that keeps up stays near
    0; one that does not shows it here, not as the server's latency)."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.lags: list[float] = []
        self._task: asyncio.Task | None = None

    async def _tick(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(self.interval)
            self.lags.append(max(0.0, time.perf_counter() - t - self.interval))

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc) -> None:
        assert self._task is not None
        self._task.cancel()

    def summary(self) -> dict[str, float]:
        lags = sorted(self.lags) or [0.0]
        return {"client_loop_lag_p99_ms": 1e3 * lags[int(0.99 * (len(lags) - 1))],
                "client_loop_lag_max_ms": 1e3 * lags[-1]}
