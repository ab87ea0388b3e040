"""The encoder server (`vlmserve serve MODEL --role encoder`): the vision tower alone.

    POST /v1/encode   {"images": [URL | data URL | preprocessed pixels], "transport": ...}
                      -> {"images": [{mm_hash, length, encoder_meta, handle}]}  (JSON or msgpack)
                      with "prompt": the whole encoded prompt (token ids, position data,
                      images with offsets), for an LLM server's `multi_modal_embeddings`;
                      with "consumer": handle null for images it holds (delivered.py)
    GET  /health, /stats, /metrics

This process is the HTTP front end: it checks requests, decodes image URLs (the engine's own
preprocessing: decode, resize, hash) and sends every image as pixels to the encoder core, a
process of its own (`encoder/service.py`) that holds the tower and the handle ledger.
Requests that arrive while the tower runs wait there and then go together: every step
encodes all images of all waiting requests, in forwards of at most the encoder's
`max_rows_per_forward` image rows (`--max-num-encoder-tokens`, else the step budget). Each
image gets an embedding handle recorded in the core's ledger until its consumer (an LLM
server started with `--encoder-url`) opens and releases it, or its lease runs out; images
whose handles the request's consumer opened and released recently are not encoded again
(handle null). If the core dies, requests get a 503, `/health` too, and the server exits 1.
With `--api-server-count N`, N front ends share the port and the one core (whose `/stats`
count every front end's requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import os
import time
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from vlmserve.encoder.ledger import TRANSPORTS
from vlmserve.encoder.service import EncoderCoreClient, EncoderCoreDead
from vlmserve.entrypoints.args import ServerConfig
from vlmserve.entrypoints.openai.http_util import (
    check_bearer,
    error_response,
    install_error_handlers,
    read_body,
    require_key,
)
from vlmserve.errors import InvalidImageError, InvalidRequestError
from vlmserve.inputs.processor import InputProcessor
from vlmserve.multimodal.image import RestrictedImageLoader
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.transfer.wire import (
    EncodedImageWire,
    EncodeRequest,
    EncodeResponse,
    PixelImage,
    output_to_wire,
    pixel_image,
)

logger = logging.getLogger("vlmserve.encoder_server")
MSGPACK = "application/msgpack"
MAX_PIXEL_DIM = 1 << 16  # a dimension of a preprocessed image's pixels, at most


def build_encoder_app(core: EncoderCoreClient, input_processor: InputProcessor,
                      cfg: ServerConfig, cuda: bool | None = None) -> FastAPI:
    """The front end's app over a started encoder core (``core`` starts on the app's loop);
    ``cuda``: whether the core's encoder is on a CUDA device (None: not known here)."""
    processor = input_processor.model_processor
    # data URLs, and paths under --allowed-local-media-path; no remote fetching here
    loader = RestrictedImageLoader(
        allowed_local_dir=cfg.allowed_local_media_path, max_pixels=cfg.max_image_pixels,
        max_request_pixels=cfg.max_request_pixels, max_image_bytes=cfg.max_image_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await core.start()
        try:
            yield
        finally:
            await core.close()

    app = FastAPI(title="vlmserve encoder", description="The vision tower as a service",
                  lifespan=lifespan)
    app.state.core = core
    json_decoder = msgspec.json.Decoder(EncodeRequest)
    msgpack_decoder = msgspec.msgpack.Decoder(EncodeRequest)

    def checked(i: int, img: PixelImage) -> PixelImage:
        """A preprocessed image as this server's own processor would have made it: uint8
        pixels of a shape it gives, ``encoder_meta`` the grid it computes for that shape and
        ``length`` its token count for them (else `InvalidImageError` naming the mismatch)."""
        shape = list(img.shape)
        if len(shape) not in (3, 4) or shape[-1] != 3 or not all(
                0 < d <= MAX_PIXEL_DIM for d in shape):
            raise InvalidImageError(f"image {i}: shape {shape}: expected [H, W, 3] or [N, H, "
                                    f"W, 3], each dimension from 1 to {MAX_PIXEL_DIM}")
        if len(img.pixels) != math.prod(shape):
            raise InvalidImageError(f"image {i}: {len(img.pixels)} bytes of pixels for shape "
                                    f"{shape}: expected {math.prod(shape)} (one byte each)")
        try:
            tokens = processor.pixel_tokens(shape, img.encoder_meta)
        except InvalidImageError as e:
            raise InvalidImageError(f"image {i}: {e}") from None
        if img.length != tokens or not 0 < tokens <= processor.max_image_tokens:
            raise InvalidImageError(
                f"image {i}: length {img.length}: this server computes {tokens} tokens for "
                f"encoder_meta {list(img.encoder_meta)}, at most {processor.max_image_tokens} "
                "an image")
        # the name the core knows it by binds its pixels: a client's mm_hash is a claim, and
        # two images of one name in one forward would share one image's rows
        digest = hashlib.blake2b(repr((shape, list(img.encoder_meta))).encode(),
                                 digest_size=16)
        digest.update(img.pixels)
        return msgspec.structs.replace(img, mm_hash=f"{img.mm_hash}/{digest.hexdigest()}")

    def preprocess(req: EncodeRequest) -> tuple[ProcessedPrompt | None, list[PixelImage]]:
        """The request's prompt (with a prompt) and its images as pixels (the engine's own
        preprocessing decodes, resizes and hashes the URLs)."""
        if not req.images:
            raise InvalidRequestError("images: give at least one image")
        if len(req.images) > cfg.mm_limit("image"):
            raise InvalidRequestError(f"images: at most {cfg.mm_limit('image')} per request "
                                      "(--limit-mm-per-prompt)")
        if req.transport not in TRANSPORTS:
            raise InvalidRequestError(f"transport: one of {', '.join(TRANSPORTS)}")
        if cuda is False and (req.transport == "cuda" or req.transport == "auto"
                              and cfg.encoder_transport == "cuda"):
            raise InvalidRequestError("transport: cuda handles need an encoder on a CUDA "
                                      "device; this one runs on the CPU (shm or bytes)")
        urls = [src for src in req.images if isinstance(src, str)]
        if req.prompt is not None:
            if len(urls) != len(req.images):
                raise InvalidRequestError("images: with a prompt, give image URLs")
            prompt = input_processor.process({"prompt": req.prompt, "multi_modal_data": {
                "image": loader.load_all(urls)}})
            return prompt, [pixel_image(img) for img in prompt.images]
        decoded = iter(input_processor.process({
            "prompt_token_ids": [processor.image_token_id, 0] * len(urls),
            "multi_modal_data": {"image": loader.load_all(urls)}}).images if urls else ())
        return None, [pixel_image(next(decoded)) if isinstance(src, str) else checked(i, src)
                      for i, src in enumerate(req.images)]

    api_key = cfg.api_key or os.environ.get("VLMSERVE_API_KEY") or None

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, e: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(e))

    @app.exception_handler(EncoderCoreDead)
    async def _dead(_: Request, e: EncoderCoreDead) -> JSONResponse:
        return error_response(503, str(e), type="server_error")

    install_error_handlers(app)
    require_key(app, api_key)  # /stats, /docs, /openapi.json

    @app.post("/v1/encode")
    async def encode(request: Request) -> Response:
        check_bearer(request, api_key)  # --api-key, as the LLM server's /v1 endpoints
        began = time.monotonic()
        body = await read_body(request, cfg)
        binary = request.headers.get("content-type", "").startswith(MSGPACK)
        try:
            req = (msgpack_decoder if binary else json_decoder).decode(body)
        except msgspec.DecodeError as e:
            return error_response(400, f"bad request body: {e}")
        prompt, images = await asyncio.to_thread(preprocess, req)
        transport = cfg.encoder_transport if req.transport == "auto" else req.transport
        if prompt is not None:  # the whole prompt: every image encoded, a handle each
            resp: Any = output_to_wire(prompt, await core.encode(images, transport,
                                                                 received_at=began))
        else:
            handles = await core.encode(images, transport, req.consumer, req.consumer_rows,
                                        began)
            names = [src.mm_hash if isinstance(src, PixelImage) else img.mm_hash
                     for src, img in zip(req.images, images, strict=True)]
            resp = EncodeResponse(images=[EncodedImageWire(
                mm_hash=name, length=img.length, encoder_meta=tuple(img.encoder_meta),
                handle=h) for name, img, h in zip(names, images, handles, strict=True)])
        if MSGPACK in request.headers.get("accept", "") or binary:
            return Response(msgspec.msgpack.encode(resp), media_type=MSGPACK)
        return Response(msgspec.json.encode(resp), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        if core.dead is not None:
            return error_response(503, str(core.dead), type="server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(await core.stats())

    registry = CollectorRegistry()
    gauges = {name: Gauge(f"vlmserve_encoder_{name}", help_text, registry=registry)
              for name, help_text in _GAUGES.items()}

    @app.get("/metrics")
    async def metrics() -> Response:
        s = await core.stats()
        values = {**s["ledger"], **{k: v for k, v in s.items() if k != "ledger"}}
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
