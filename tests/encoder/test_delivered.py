"""An encoder server remembers which images each consumer (an LLM server) holds: images whose
handles that consumer opened and released are answered "known" (no handle, nothing exported)
to any of its clients, never to another consumer's, and never for a handle reclaimed or
released unread. End to end, images that reach the LLM server through different preprocessing
processes are encoded once, with the single server's answers."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.e2e.test_server import data_url, greedy, user
from tests.e2e.test_server_procs import MODEL, ServeProc, _stream
from tests.encoder.helpers import wait_until
from tests.engine.helpers import make_image
from vlmserve import LLM
from vlmserve.encoder.client import EncoderClient
from vlmserve.inputs.processor import InputProcessor
from vlmserve.models.metadata import load_model_processor, text_config
from vlmserve.transfer.delivered import DeliveredImages
from vlmserve.transfer.wire import from_wire

LEASE_S = 3.0


@pytest.fixture(scope="module")
def encoder_url(vlmserve_cache):
    enc = ServeProc("--role", "encoder", "--encoder-lease", str(LEASE_S))
    yield enc.url
    enc.kill()


@pytest.fixture(scope="module")
def images(vlmserve_cache):
    """``images(*seeds)``: one preprocessed image (56x56 px) per seed, as a front end has it."""
    _, hf_config, model_processor = load_model_processor(MODEL)
    processor = InputProcessor(model_processor, text_config(hf_config).vocab_size)
    pad = "<|vision_start|><|image_pad|><|vision_end|>"

    def make(*seeds: int) -> list:
        return processor.process({"prompt": pad * len(seeds), "multi_modal_data": {
            "image": [make_image(56, 56, 100 + s) for s in seeds]}}).images
    return make


def _stats(url: str) -> dict:
    return httpx.get(url + "/stats", timeout=10).json()


def _open(url: str, encoded) -> None:
    """Open and release the handles as an engine core does; until the server has heard."""
    released = _stats(url)["ledger"]["released"]
    for e in encoded:
        from_wire(e.handle).open()
    assert wait_until(lambda: _stats(url)["ledger"]["released"] == released + len(encoded), 5)


def test_clients_of_one_consumer_share_what_it_holds(encoder_url, images) -> None:
    """Two clients of consumer "a" (two preprocessing processes): once the first one's handle
    of x is released, the second gets x as known (no export) and y with a handle; a repeated
    known image is known twice over; consumer "b" gets x with a handle."""
    x, y = images(1, 2)
    first, second = (EncoderClient([encoder_url], consumer="a", consumer_rows=4096)
                     for _ in range(2))
    other = EncoderClient([encoder_url], consumer="b")
    (enc_x,) = first.encode([x])
    assert enc_x.handle is not None
    _open(encoder_url, [enc_x])
    before = _stats(encoder_url)
    got = second.encode([x, y])
    assert got[0] is None and got[1].handle is not None
    assert (second.known_images, second.sent_images, second.skipped_images) == (1, 1, 0)
    after = _stats(encoder_url)
    assert after["ledger"]["exported"] == before["ledger"]["exported"] + 1  # y's
    assert after["known_images"] == before["known_images"] + 1
    assert after["encoded_images"] == before["encoded_images"] + 1
    _open(encoder_url, [got[1]])
    # the server answers each occurrence of a known image without a handle (the client sends
    # one of each; _post is what it sends)
    assert [e.handle for e in EncoderClient([encoder_url], consumer="a")._post([x, y, x])] == (
        [None] * 3)
    (enc_b,) = other.encode([x])
    assert enc_b.handle is not None and other.known_images == 0
    _open(encoder_url, [enc_b])
    # clients without a consumer id (older LLM servers) get handles as before
    (enc_old,) = EncoderClient([encoder_url]).encode([x])
    assert enc_old.handle is not None
    _open(encoder_url, [enc_old])
    assert _stats(encoder_url)["ledger"]["live_handles"] == 0


def test_handles_never_opened_teach_nothing(encoder_url, images) -> None:
    """A handle released unread, and one left to its lease (reclaimed), do not make their
    images known: the next client of the same consumer gets handles for both."""
    x, y = images(3, 4)
    enc_x, enc_y = EncoderClient([encoder_url], consumer="c").encode([x, y])
    from_wire(enc_x.handle).release()  # given up unread
    before = _stats(encoder_url)["ledger"]
    assert wait_until(lambda: _stats(encoder_url)["ledger"]["reclaimed"] == before["reclaimed"]
                      + 1, LEASE_S + 3)  # y's handle, at its lease
    assert _stats(encoder_url)["ledger"]["live_handles"] == 0
    again = EncoderClient([encoder_url], consumer="c").encode([x, y])
    assert all(e is not None and e.handle is not None for e in again)
    _open(encoder_url, again)


def test_images_through_two_front_ends_are_encoded_once(encoder_url) -> None:
    """An LLM server with 2 front ends (2 encoder clients): the same image in sequential
    requests (the kernel spreads their connections over the front ends) is exported once and
    known after; every answer is the single server's, every handle opened and released."""
    llm = ServeProc("--encoder-url", encoder_url, "--api-server-count", "2")
    try:
        conv = user("Describe.", data_url(make_image(84, 56, 31)))
        ref = LLM(MODEL, dtype="float32", device="cpu", max_model_len=1024,
                  max_num_batched_tokens=256)
        want = ref.chat([conv], greedy(8), use_tqdm=False)[0].outputs[0].text
        before = _stats(encoder_url)

        async def ask() -> str:
            async with llm.client() as client:
                return await _stream(client, conv, 8)

        sent = 0
        while sent < 16 and _stats(encoder_url)["known_images"] == before["known_images"]:
            assert asyncio.run(ask()) == want
            sent += 1
            # the engine core's release has reached the encoder before the next request
            assert wait_until(lambda: (s := _stats(encoder_url)["ledger"])["live_handles"] == 0
                              and s["released"] > before["ledger"]["released"], 10)
        after = _stats(encoder_url)
        assert after["known_images"] > before["known_images"], f"{sent} requests"
        assert after["ledger"]["exported"] - before["ledger"]["exported"] == 1 < sent
        assert after["ledger"]["released"] - before["ledger"]["released"] == 1
        assert after["ledger"]["reclaimed"] == before["ledger"]["reclaimed"]
        core = llm.stats()
        assert core["encoder_handles_opened"] == core["encoder_handles_released"] == 1
        assert core["encoder_handles_live"] == core["encoder_handles_failed"] == 0
    finally:
        llm.kill()


def test_delivered_images_bounds() -> None:
    """Per consumer, the latest delivered images up to its rows (a known answer refreshes
    one); at most `max_consumers` consumers; a handle freed undelivered or never announced
    teaches nothing; a smaller cache forgets the oldest at once."""
    d = DeliveredImages(max_consumers=2)
    assert d.known("a", 10, ["x", "y", "z"]) == set()
    d.exported("a", [("h1", "x", 4), ("h2", "y", 4), ("h3", "z", 4)])
    d.freed("h1", True)
    d.freed("h2", False)  # reclaimed, or released unread
    d.freed("h9", True)  # not exported for a consumer
    assert d.known("a", 10, ["x", "y"]) == {"x"}
    d.freed("h3", True)
    d.exported("a", [("h4", "w", 4)])
    d.freed("h4", True)  # 12 rows > 10: the least recent (x) goes
    assert d.known("a", 10, ["x", "z", "w"]) == {"z", "w"}
    assert d.known("a", 4, ["z", "w"]) == {"w"}  # its cache is smaller now
    assert d.known("b", None, ["w"]) == set()
    d.known("c", None, [])  # a third consumer: "a" (least recent) is forgotten
    assert d.known("a", 10, ["w"]) == set()
    assert d.known_images == 4
