"""The encoder server (`vlmserve serve MODEL --role encoder`): the vision tower alone.

    POST /v1/encode   {"images": [URL | data URL | preprocessed pixels], "transport": ...}
                      -> {"images": [{mm_hash, length, encoder_meta, handle}]}  (JSON or msgpack)
                      with "prompt": the whole encoded prompt (token ids, position data,
                      images with offsets), for an LLM server's `multi_modal_embeddings`;
                      with "consumer": handle null for images it holds (delivered.py)
    GET  /health, /stats, /metrics

Requests that arrive while the tower runs wait and then go together: every step encodes all
images of all waiting requests, in forwards (`MultimodalEncoder.encode`) of at most the
encoder's `max_rows_per_forward` image rows (`--max-num-encoder-tokens`, else the step
budget). Each image gets an embedding handle recorded in the encoder's ledger until its
consumer (an LLM server started with `--encoder-url`) opens and releases it, or its lease
runs out; images whose handles the request's consumer opened and released recently are not
encoded again (handle null).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import queue
import threading
import time
from typing import Any

import msgspec
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from vlmserve.encoder.encoder import EncoderOutput, MultimodalEncoder
from vlmserve.encoder.ledger import TRANSPORTS
from vlmserve.encoder.wire import (
    EncodedImageWire,
    EncodeRequest,
    EncodeResponse,
    PixelImage,
    output_to_wire,
    to_wire,
)
from vlmserve.entrypoints.args import ServerConfig
from vlmserve.entrypoints.openai.http_util import (
    check_bearer,
    error_response,
    install_error_handlers,
    read_body,
)
from vlmserve.errors import InvalidImageError, InvalidRequestError
from vlmserve.multimodal.image import RestrictedImageLoader
from vlmserve.multimodal.inputs import ImageInput, ProcessedPrompt

logger = logging.getLogger("vlmserve.encoder_server")
MSGPACK = "application/msgpack"


@dataclasses.dataclass
class ServerTimes:
    """Where an encode request's time goes on this server (seconds, summed): the whole request
    (`request_s`: body read to answer), a job's wait for the encoder thread (`queue_s`), and
    the forwards (`forward_s`: the host's time in `encode`, launch and export; the device's
    work may still run after it)."""
    requests: int = 0
    request_s: float = 0.0
    jobs: int = 0
    queue_s: float = 0.0
    forwards: int = 0
    forward_s: float = 0.0
    max_jobs_per_forward: int = 0

    def summary(self) -> dict[str, float]:
        def ms(total: float, n: int) -> float:
            return round(1e3 * total / n, 3) if n else 0.0
        return {**dataclasses.asdict(self), "mean_request_ms": ms(self.request_s, self.requests),
                "mean_queue_ms": ms(self.queue_s, self.jobs),
                "mean_forward_ms": ms(self.forward_s, self.forwards)}


class _Batcher:
    """One thread owns the encoder: it takes every waiting job and encodes them together, in
    forwards of at most the encoder's `max_rows_per_forward` image rows."""

    def __init__(self, encoder: MultimodalEncoder) -> None:
        self.encoder = encoder
        self.times = ServerTimes()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="vlmserve-encoder", daemon=True)
        self._thread.start()

    async def encode(self, prompt: ProcessedPrompt, transport: str) -> EncoderOutput:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._jobs.put((prompt, transport, loop, fut, time.perf_counter()))
        return await fut

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            jobs = [job]
            while True:
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._jobs.put(None)
                    break
                jobs.append(more)
            t = self.times
            for group in _forwards(jobs, self.encoder.max_rows_per_forward):
                began = time.perf_counter()
                t.jobs += len(group)
                t.queue_s += sum(began - j[4] for j in group)
                try:
                    results: list[Any] = self.encoder.encode([j[0] for j in group],
                                                             transport=group[0][1])
                except Exception as e:  # noqa: BLE001 - each waiting request is told
                    logger.exception("encoding failed")
                    results = [e] * len(group)
                t.forwards += 1
                t.forward_s += time.perf_counter() - began
                t.max_jobs_per_forward = max(t.max_jobs_per_forward, len(group))
                for (_, _, loop, fut, _), result in zip(group, results, strict=True):
                    loop.call_soon_threadsafe(_settle, fut, result)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(30)


def _forwards(jobs: list[tuple], max_rows: int) -> list[list[tuple]]:
    """The waiting jobs as tower forwards, in arrival order: one per handle kind asked, each
    of at most ``max_rows`` image rows (a job larger than that alone), so a burst of
    requests is neither one unbounded forward nor one forward per request."""
    out: list[list[tuple]] = []
    for transport in dict.fromkeys(j[1] for j in jobs):
        group: list[tuple] = []
        rows = 0
        for job in (j for j in jobs if j[1] == transport):
            n = sum(img.length for img in job[0].images)
            if group and rows + n > max_rows:
                out.append(group)
                group, rows = [], 0
            group.append(job)
            rows += n
        out.append(group)
    return out


def _settle(fut: asyncio.Future, result: Any) -> None:
    if fut.done():  # the client left
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)


def build_encoder_app(encoder: MultimodalEncoder, cfg: ServerConfig) -> FastAPI:
    processor = encoder.model_processor
    # data URLs, and paths under --allowed-local-media-path; no remote fetching here
    loader = RestrictedImageLoader(
        allowed_local_dir=cfg.allowed_local_media_path, max_pixels=cfg.max_image_pixels,
        max_request_pixels=cfg.max_request_pixels, max_image_bytes=cfg.max_image_bytes)
    batcher = _Batcher(encoder)
    app = FastAPI(title="vlmserve encoder", description="The vision tower as a service")
    app.state.encoder, app.state.batcher = encoder, batcher
    json_decoder = msgspec.json.Decoder(EncodeRequest)
    msgpack_decoder = msgspec.msgpack.Decoder(EncodeRequest)

    def from_pixels(img: PixelImage) -> ImageInput:
        n = math.prod(img.shape)
        if (len(img.shape) not in (3, 4) or img.shape[-1] != 3 or n <= 0
                or len(img.pixels) != n or not 0 < img.length <= processor.max_image_tokens):
            raise InvalidImageError(f"image {img.mm_hash[:12]}: {len(img.pixels)} bytes of "
                                    f"pixels for shape {img.shape}, {img.length} tokens")
        pixels = torch.frombuffer(bytearray(img.pixels), dtype=torch.uint8).view(img.shape)
        return ImageInput(img.mm_hash, 0, img.length, pixels, tuple(img.encoder_meta),
                          processor.pixel_transform)

    def preprocess(req: EncodeRequest) -> ProcessedPrompt:
        """The request's prompt, or its images as one prompt of image placeholders (the
        engine's own preprocessing decodes, resizes and hashes the URLs)."""
        if not req.images:
            raise InvalidRequestError("images: give at least one image")
        if len(req.images) > cfg.limit_mm_per_prompt:
            raise InvalidRequestError(f"images: at most {cfg.limit_mm_per_prompt} per request")
        if req.transport not in TRANSPORTS:
            raise InvalidRequestError(f"transport: one of {', '.join(TRANSPORTS)}")
        urls = [src for src in req.images if isinstance(src, str)]
        if req.prompt is not None:
            if len(urls) != len(req.images):
                raise InvalidRequestError("images: with a prompt, give image URLs")
            return encoder.process({"prompt": req.prompt,
                                    "multi_modal_data": {"image": loader.load_all(urls)}})
        decoded = iter(encoder.process({
            "prompt_token_ids": [processor.image_token_id, 0] * len(urls),
            "multi_modal_data": {"image": loader.load_all(urls)}}).images if urls else ())
        images = [next(decoded) if isinstance(src, str) else from_pixels(src)
                  for src in req.images]
        return ProcessedPrompt(None, [], images)

    async def encode_images(prompt: ProcessedPrompt, req: EncodeRequest,
                            transport: str) -> EncodeResponse:
        """A handle per image, None for those ``req.consumer`` holds already."""
        known = (encoder.delivered.known(req.consumer, req.consumer_rows,
                                         [img.mm_hash for img in prompt.images])
                 if req.consumer is not None else set())
        todo = [img for img in prompt.images if img.mm_hash not in known]
        encoded = []
        if todo:
            encoded = (await batcher.encode(ProcessedPrompt(None, [], todo), transport)).images
        if req.consumer is not None:
            encoder.delivered.exported(req.consumer, [(e.handle.handle_id, e.mm_hash, e.length)
                                                      for e in encoded])
        handles = iter(encoded)
        return EncodeResponse(images=[EncodedImageWire(
            mm_hash=img.mm_hash, length=img.length, encoder_meta=tuple(img.encoder_meta),
            handle=None if img.mm_hash in known else to_wire(next(handles).handle))
            for img in prompt.images])

    api_key = cfg.api_key or os.environ.get("VLMSERVE_API_KEY") or None

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, e: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(e))

    install_error_handlers(app)

    @app.post("/v1/encode")
    async def encode(request: Request) -> Response:
        check_bearer(request, api_key)  # --api-key, as the LLM server's /v1 endpoints
        began = time.perf_counter()
        body = await read_body(request, cfg)
        binary = request.headers.get("content-type", "").startswith(MSGPACK)
        try:
            req = (msgpack_decoder if binary else json_decoder).decode(body)
        except msgspec.DecodeError as e:
            return error_response(400, f"bad request body: {e}")
        prompt = await asyncio.to_thread(preprocess, req)
        transport = encoder.transport if req.transport == "auto" else req.transport
        resp: Any = (output_to_wire(await batcher.encode(prompt, transport))
                     if req.prompt is not None else await encode_images(prompt, req, transport))
        batcher.times.requests += 1
        batcher.times.request_s += time.perf_counter() - began
        if MSGPACK in request.headers.get("accept", "") or binary:
            return Response(msgspec.msgpack.encode(resp), media_type=MSGPACK)
        return Response(msgspec.json.encode(resp), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/stats")
    async def stats() -> JSONResponse:
        return JSONResponse({**dataclasses.asdict(encoder.get_stats()),
                             "server": batcher.times.summary()})

    registry = CollectorRegistry()
    gauges = {name: Gauge(f"vlmserve_encoder_{name}", help_text, registry=registry)
              for name, help_text in _GAUGES.items()}

    @app.get("/metrics")
    async def metrics() -> Response:
        s = encoder.get_stats()
        values = {**vars(s.ledger), **{k: v for k, v in vars(s).items() if k != "ledger"}}
        for name, gauge in gauges.items():
            gauge.set(values.get(name, 0))
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


_GAUGES = {
    "requests": "Requests encoded.",
    "images": "Images in the requests encoded.",
    "encoded_images": "Distinct images through the vision tower.",
    "batches": "Vision-tower forwards.",
    "known_images": "Images answered as held by their consumer already (not encoded again).",
    "live_handles": "Embedding handles exported and not freed yet.",
    "live_bytes": "Bytes held for live handles (shared memory, GPU blocks).",
    "exported": "Embedding handles exported.",
    "released": "Handles freed on their consumer's release.",
    "reclaimed": "Handles freed at their lease, never released by a consumer.",
    "double_opens": "Opens of a handle already opened or released.",
}


def encoder_kwargs(cfg: ServerConfig, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """`MultimodalEncoder` options of `vlmserve serve --role encoder`."""
    return {**engine_kwargs, "lease_s": cfg.encoder_lease,
            "ledger_address": cfg.encoder_ledger_address,
            "transport": cfg.encoder_transport}
