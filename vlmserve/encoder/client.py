"""An LLM server's client of encoder servers (`vlmserve serve --encoder-url URL[,URL...]`).

A front end has preprocessed a request (images decoded, resized and hashed, prompt expanded);
`EncoderClient.encode` sends the images' pixels to an encoder server (`POST /v1/encode`,
msgpack), round-robin over the URLs, trying the next one when a server cannot be reached or
answers with a server error, and returns an embedding handle per image for the engine core to
open. Images whose content hash this client had encoded recently are not sent again: the
engine core's encoder cache very likely still holds them, and their pixels travel with the
request so that the core encodes them itself if it does not. The same holds for the images the
encoder server answers as "known" (no handle): handles of theirs were recently opened and
released by the same LLM server (`consumer_id`), through another of its clients (each front end
and preprocessing process has one).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import socket
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from vlmserve.multimodal.inputs import ImageInput
from vlmserve.transfer.wire import EncodedImageWire, EncodeRequest, EncodeResponse, pixel_image

if TYPE_CHECKING:
    from vlmserve.engine.messages import ImageData

logger = logging.getLogger(__name__)
MSGPACK = "application/msgpack"


class EncoderUnavailableError(RuntimeError):
    """No encoder server could encode a request's images."""


def _is_local(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        return all(info[4][0].startswith("127.") or info[4][0] == "::1"
                   for info in socket.getaddrinfo(host, None))
    except OSError:
        return False


def consumer_id(core_address: str) -> str:
    """An LLM server's id at its encoder servers, from its engine core's address: the same for
    all its front ends and their preprocessing processes, another for every other server (or
    a restarted one)."""
    return hashlib.sha256(f"{socket.gethostname()} {core_address}".encode()).hexdigest()[:24]


class EncoderClient:
    """Args:
        urls: base URLs of encoder servers (``http://host:port``).
        transport: handle kind to ask for; ``auto``: the server's own (CUDA IPC or shared
            memory) for a server on this host, ``bytes`` for one on another host.
        timeout: seconds for one server to answer.
        api_key: the encoder servers' key (default: ``$VLMSERVE_ENCODER_API_KEY``).
        remember: content hashes of images encoded recently to keep (not sent again).
        consumer: this LLM server's `consumer_id`; images the server knows it holds come
            back without a handle (None: every image sent gets one).
        consumer_rows: the rows of the engine core's encoder cache (what it can hold).
    """

    def __init__(self, urls: Sequence[str], transport: str = "auto", timeout: float = 60.0,
                 remember: int = 4096, api_key: str | None = None,
                 consumer: str | None = None, consumer_rows: int | None = None) -> None:
        import httpx

        # the encoder servers' --api-key (`vlmserve serve --encoder-api-key` sets the variable)
        api_key = api_key or os.environ.get("VLMSERVE_ENCODER_API_KEY")
        self._auth = {"authorization": f"Bearer {api_key}"} if api_key else {}

        self.urls = [u.rstrip("/") for u in urls if u.strip()]
        if not self.urls:
            raise ValueError("no encoder URL given")
        self.transports = [transport if transport != "auto" or _is_local(u) else "bytes"
                           for u in self.urls]
        self.consumer, self.consumer_rows = consumer, consumer_rows
        self._http = httpx.Client(timeout=timeout)
        self._next = itertools.count()
        self._remember = remember
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self._decoder = msgspec.msgpack.Decoder(EncodeResponse)
        self._encoder = msgspec.msgpack.Encoder()
        # images: encoded (a handle), not sent (sent recently), sent and known to the server
        self.sent_images = self.skipped_images = self.known_images = self.failovers = 0
        self.posts, self.post_s = 0, 0.0  # answered posts, and their round trips (seconds)

    def encode(self, images: Sequence[ImageInput | ImageData]
               ) -> list[EncodedImageWire | None]:
        """A handle per image; None for the images not sent (sent recently) or answered as
        known (the engine core holds them already): their pixels go to the core. Raises
        `EncoderUnavailableError` when no server would encode them (each was unreachable,
        failed or refused them: the images passed this server's own checks, so a refusal
        is a deployment mismatch, a 503, not the user's 400)."""
        with self._lock:
            send = [img for img in images if img.mm_hash not in self._recent]
            # remembered from now: a request on another thread with the same image does not
            # send it too (its pixels go to the core, which finds the rows cached or encodes)
            for img in images:
                self._recent[img.mm_hash] = None
                self._recent.move_to_end(img.mm_hash)
            while len(self._recent) > self._remember:
                self._recent.popitem(last=False)
        unique = list({img.mm_hash: img for img in send}.values())
        out: dict[str, EncodedImageWire] = {}
        if unique:
            try:
                encoded = self._post(unique)
            except BaseException:
                with self._lock:  # not encoded after all
                    for img in unique:
                        self._recent.pop(img.mm_hash, None)
                raise
            for img, enc in zip(unique, encoded, strict=True):
                if enc.handle is not None:
                    out[img.mm_hash] = enc
        with self._lock:
            self.sent_images += len(out)
            self.known_images += len(unique) - len(out)
            self.skipped_images += len(images) - len(send)
        # each occurrence needs a handle of its own: a repeated image within the request is
        # opened once by the core, the other occurrences go with their pixels
        result: list[EncodedImageWire | None] = []
        for img in images:
            result.append(out.pop(img.mm_hash, None))
        return result

    def _post(self, images: list[ImageInput]) -> list[EncodedImageWire]:
        start = next(self._next)
        errors = []
        for k in range(len(self.urls)):
            i = (start + k) % len(self.urls)
            body = self._encoder.encode(EncodeRequest(
                images=[pixel_image(img) for img in images], transport=self.transports[i],
                consumer=self.consumer, consumer_rows=self.consumer_rows))
            began = time.perf_counter()
            try:
                r = self._http.post(self.urls[i] + "/v1/encode", content=body,
                                    headers={"content-type": MSGPACK, "accept": MSGPACK,
                                             **self._auth})
            except Exception as e:  # noqa: BLE001 - unreachable, timed out: the next one
                errors.append(f"{self.urls[i]}: {type(e).__name__}: {e}")
            else:
                if r.status_code == 200:
                    got = self._decoder.decode(r.content).images
                    with self._lock:
                        self.posts += 1
                        self.post_s += time.perf_counter() - began
                    if [g.mm_hash for g in got] != [img.mm_hash for img in images]:
                        raise EncoderUnavailableError(
                            f"encoder server {self.urls[i]} answered for other images")
                    return got
                if r.status_code in (401, 403):  # our key, not the user's input
                    errors.append(f"{self.urls[i]}: refused this server's key "
                                  f"(--encoder-api-key): HTTP {r.status_code}")
                else:  # a refusal too: this front end checked the images (a server of
                    # another version or model, or with lower limits: not the user's fault)
                    errors.append(f"{self.urls[i]}: HTTP {r.status_code}: {r.text[:200]}")
            with self._lock:
                self.failovers += 1
            logger.warning("encoder server failed (%s); trying the next one", errors[-1])
        raise EncoderUnavailableError("no encoder server could encode the request's images: "
                                      + "; ".join(errors))

    def stats(self) -> dict[str, float]:
        """Images sent, skipped and answered as known, failovers, and the posts' mean round
        trip (pixels out, handles back)."""
        with self._lock:
            return {"sent_images": self.sent_images, "skipped_images": self.skipped_images,
                    "known_images": self.known_images, "failovers": self.failovers,
                    "posts": self.posts, "mean_post_ms":
                    round(1e3 * self.post_s / self.posts, 3) if self.posts else 0.0}

    def close(self) -> None:
        self._http.close()
