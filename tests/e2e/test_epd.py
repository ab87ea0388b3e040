"""Encode / prefill-decode as real servers on loopback ports: `vlmserve serve --role encoder`
and `vlmserve serve --encoder-url ...`. The LLM server's answers equal a single process's;
every embedding handle is opened once and released (none live, no shared-memory segment
left); images encoded recently are not sent again; a dead encoder URL fails over to the
next; bad input to /v1/encode is a 400."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import threading
import time

import httpx
import msgspec
import pytest

from tests.e2e.test_server import data_url, greedy, user
from tests.e2e.test_server_procs import MODEL, ServeProc, _alive, _free_port, _stream
from tests.encoder.helpers import segments, wait_until
from tests.engine.helpers import make_image, make_mp4
from vlmserve import LLM
from vlmserve.transfer.wire import EncodeResponse, from_wire

IMAGES = [make_image(56, 56, 1), make_image(84, 56, 2), make_image(56, 112, 3)]


@pytest.fixture(scope="module")
def epd(vlmserve_cache):
    """An encoder server and an LLM server using it (a dead URL first: it fails over)."""
    enc = ServeProc("--role", "encoder", "--encoder-lease", "20")
    dead = f"http://127.0.0.1:{_free_port()}"
    try:
        llm = ServeProc("--encoder-url", f"{dead},{enc.url}", "--preprocess-workers", "1")
    except BaseException:
        enc.kill()
        raise
    yield enc, llm
    llm.kill()
    enc.kill()


def _single_process(convs: list[list[dict]], n: int, model: str = MODEL) -> list[str]:
    """What one process answers (`LLM.chat`, greedy, ``n`` tokens)."""
    ref = LLM(model, dtype="float32", device="cpu", max_model_len=1024,
              max_num_batched_tokens=256)
    return [o.outputs[0].text for o in ref.chat(convs, greedy(n), use_tqdm=False)]


def _streamed_together(llm: ServeProc, convs: list[list[dict]], n: int) -> list[str]:
    """The LLM server's answers, all streamed at once."""
    async def run_all() -> list[str]:
        async with llm.client() as client:
            return list(await asyncio.gather(*(_stream(client, m, n) for m in convs)))

    return asyncio.run(run_all())


def _conversations() -> list[list[dict]]:
    urls = [data_url(img) for img in IMAGES]
    return [user("Describe.", urls[0]), user("Compare.", urls[1], urls[2]),
            user("Again.", urls[0], urls[1]), user("No image here."),
            user("Twice.", urls[2], urls[2])]


def test_epd_answers_like_one_process_and_frees_every_handle(epd) -> None:
    enc, llm = epd
    convs = _conversations()
    expected = _single_process(convs, 12)

    async def run_all() -> list[str]:
        async with llm.client() as client:
            out = [await _stream(client, convs[0], 12)]  # image 0 alone first
            return out + list(await asyncio.gather(*(_stream(client, m, 12)
                                                     for m in convs[1:])))

    assert asyncio.run(run_all()) == expected
    stats = httpx.get(enc.url + "/stats", timeout=10).json()
    # the three distinct images, each sent once: image 0 was encoded for the first request
    # and not sent again; a repeated image in one request is sent once
    assert stats["encoded_images"] == 3
    assert wait_until(lambda: httpx.get(enc.url + "/stats").json()["ledger"]["live_handles"]
                      == 0, 10)
    ledger = httpx.get(enc.url + "/stats").json()["ledger"]
    assert ledger["exported"] == ledger["released"] == 3 and ledger["reclaimed"] == 0
    assert ledger["double_opens"] == 0
    assert segments(f"vlms-{stats['core_pid']}x") == []
    core = llm.stats()
    assert core["encoder_handles_opened"] == core["encoder_handles_released"] == 3
    # where an encode's time goes: the front end's round trips, the server's side of them
    client, server = core["encoder_client"], stats["server"]
    assert client["sent_images"] == 3  # (failovers: the fixture names a dead server first)
    assert client["posts"] == server["requests"] == server["jobs"] >= 2
    assert 1 <= server["forwards"] <= server["jobs"]
    assert 0 < server["mean_forward_ms"] and 0 < server["mean_request_ms"] < client["mean_post_ms"]
    assert core["encoder_handles_live"] == core["encoder_handles_failed"] == 0
    metrics = httpx.get(enc.url + "/metrics").text
    assert "vlmserve_encoder_live_handles 0.0" in metrics
    assert "vlmserve_encoder_handles_opened 3.0" in httpx.get(llm.url + "/metrics").text


def test_encode_endpoint_json_and_its_errors(epd) -> None:
    enc, _ = epd
    r = httpx.post(enc.url + "/v1/encode", json={"images": [data_url(make_image(56, 84, 9))],
                                                  "transport": "bytes"}, timeout=60)
    assert r.status_code == 200, r.text
    img = msgspec.json.decode(r.content, type=EncodeResponse).images[0]
    assert img.length == 6 and img.encoder_meta == (1, 6, 4)  # 84x56 px: 6x4 patches, merged 2x2
    rows = from_wire(img.handle).open()
    assert rows.shape[0] == img.length and rows.abs().sum() > 0
    for body, needle in [({"images": []}, "at least one image"),
                         ({"images": ["data:image/png;base64,AAAA"]}, "image 1"),
                         ({"images": ["/etc/passwd"]}, "local image paths are not allowed"),
                         ({"images": [data_url(IMAGES[0])], "transport": "pigeon"},
                          "transport"),
                         ({"imgs": []}, "imgs")]:
        r = httpx.post(enc.url + "/v1/encode", json=body, timeout=60)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (body, r.text)
    assert httpx.get(enc.url + "/health").status_code == 200


def _pixel_image(**kw) -> dict:
    """A preprocessed 56x56 image as JSON (4 tokens: a 4x4 patch grid, merged 2x2), with
    ``kw`` over it."""
    return {"mm_hash": "p" * 64, "encoder_meta": [1, 4, 4], "length": 4, "shape": [56, 56, 3],
            "pixels": base64.b64encode(bytes(range(56)) * 168).decode(), **kw}


@pytest.mark.parametrize("image, transport, words", [
    # the reproduction: (-1, -1, 3) passed prod(shape) == len(pixels) and killed the core
    ({"mm_hash": "x", "encoder_meta": [1, 2, 2], "length": 1, "shape": [-1, -1, 3],
      "pixels": "BwcH"}, "bytes", ["shape", "-1"]),
    (_pixel_image(shape=[0, 56, 3]), "bytes", ["shape"]),
    (_pixel_image(shape=[56, 56, 4]), "bytes", ["shape"]),
    (_pixel_image(shape=[2**40, 2**40, 3]), "bytes", ["shape"]),
    (_pixel_image(shape=[1, 56, 56, 3, 1]), "bytes", ["shape"]),
    (_pixel_image(shape=[28, 112, 3]), "bytes", ["encoder_meta"]),
    (_pixel_image(pixels="AAAA"), "bytes", ["bytes of pixels"]),
    (_pixel_image(encoder_meta=[]), "bytes", ["encoder_meta"]),
    (_pixel_image(encoder_meta=[1, 4]), "bytes", ["encoder_meta"]),
    (_pixel_image(encoder_meta=[0, 4, 4]), "bytes", ["encoder_meta"]),
    (_pixel_image(encoder_meta=[1, -4, -4]), "bytes", ["encoder_meta"]),
    (_pixel_image(encoder_meta=[1, 4, 8]), "bytes", ["encoder_meta"]),
    (_pixel_image(encoder_meta=[2, 4, 4]), "bytes", ["encoder_meta"]),
    (_pixel_image(encoder_meta=[1, 2**70, 4]), "bytes", ["encoder_meta"]),
    (_pixel_image(shape=[42, 42, 3], pixels=base64.b64encode(bytes(42 * 42 * 3)).decode(),
                  encoder_meta=[1, 3, 3], length=2), "bytes", ["shape"]),
    (_pixel_image(length=3), "bytes", ["length", "4"]),
    (_pixel_image(length=0), "bytes", ["length"]),
    (_pixel_image(), "cuda", ["cuda"]),  # a CPU encoder has no CUDA handles to give
])
def test_malformed_pixel_images_are_400s_and_the_encoder_lives(epd, image, transport,
                                                                words) -> None:
    """Preprocessed pixels are checked against what the server's own processor computes for
    their shape (grid, token count) before the core sees them: each mistake is a 400 naming
    it, and the encoder core (the same process) still encodes a good image after it."""
    enc, _ = epd
    core = enc.stats()["core_pid"]
    r = httpx.post(enc.url + "/v1/encode", json={"transport": transport, "images": [image]},
                   timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message
    r = httpx.post(enc.url + "/v1/encode", json={"transport": "bytes",
                                                  "images": [_pixel_image()]}, timeout=60)
    assert r.status_code == 200, r.text
    assert msgspec.json.decode(r.content, type=EncodeResponse).images[0].handle.shape[0] == 4
    assert httpx.get(enc.url + "/health").status_code == 200
    assert enc.stats()["core_pid"] == core


def test_a_clients_mm_hash_names_only_its_own_pixels(vlmserve_cache) -> None:
    """Two pixel images under one mm_hash (a client may claim any hash) reach the encoder
    core under names that bind their pixels: one forward never gives one of them the
    other's rows. The same pixels keep one name (encoded once); answers carry the hash
    the client gave."""
    from fastapi.testclient import TestClient

    from vlmserve.encoder.encoder import encoder_input_processor
    from vlmserve.entrypoints.args import ServerConfig
    from vlmserve.entrypoints.openai.encoder_server import build_encoder_app
    from vlmserve.models.metadata import load_model_processor

    class Core:  # the encoder core's client, recording what it is sent
        dead = None
        sent: list = []

        async def start(self) -> None: ...

        async def close(self) -> None: ...

        async def encode(self, images, transport, *args, **kwargs):
            self.sent += images
            return [None] * len(images)

    path, hf_config, _ = load_model_processor(MODEL)
    core = Core()
    app = build_encoder_app(core, encoder_input_processor(path, hf_config), ServerConfig(),
                            cuda=False)
    other = base64.b64encode(bytes(range(1, 57)) * 168).decode()
    images = [_pixel_image(), _pixel_image(pixels=other), _pixel_image()]
    with TestClient(app) as client:
        r = client.post("/v1/encode", json={"transport": "bytes", "images": images})
    assert r.status_code == 200, r.text
    assert [img["mm_hash"] for img in r.json()["images"]] == ["p" * 64] * 3
    names = [img.mm_hash for img in core.sent]
    assert names[0] != names[1] and names[0] == names[2]


def test_no_encoder_reachable_is_a_503_naming_it(vlmserve_cache) -> None:
    dead = f"http://127.0.0.1:{_free_port()}"
    llm = ServeProc("--encoder-url", dead)
    try:
        r = httpx.post(llm.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": user("Hi.", data_url(IMAGES[0])), "max_tokens": 2})
        assert r.status_code == 503 and "no encoder server" in r.json()["error"]["message"]
        # text-only requests do not need the encoder
        r = httpx.post(llm.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": user("Hi."), "max_tokens": 2})
        assert r.status_code == 200
    finally:
        llm.kill()


def test_completion_with_multi_modal_embeddings_from_the_encoder_server(epd) -> None:
    """A client encodes its prompt at the encoder server (bytes handles) and sends the answer
    to the LLM server as `multi_modal_embeddings`: the same text as the prompt with its image;
    a shared-memory handle from a client is refused (the server does not accept them unless
    told to), and so is a prompt other than the one encoded."""
    enc, llm = epd
    prompt = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe."
              "<|im_end|>\n<|im_start|>assistant\n")
    image = make_image(84, 84, 21)
    ref = LLM(MODEL, dtype="float32", device="cpu", max_model_len=1024,
              max_num_batched_tokens=256)
    want = ref.generate([{"prompt": prompt, "multi_modal_data": {"image": image}}],
                        greedy(10), use_tqdm=False)[0].outputs[0].text
    before = httpx.get(enc.url + "/stats").json()["ledger"]

    def encode(transport: str) -> dict:
        r = httpx.post(enc.url + "/v1/encode", timeout=60, json={
            "prompt": prompt, "images": [data_url(image)], "transport": transport})
        assert r.status_code == 200, r.text
        return r.json()

    def complete(encoded: dict, text: str = prompt) -> httpx.Response:
        return httpx.post(llm.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": text, "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "multi_modal_embeddings": encoded})

    encoded = encode("bytes")
    assert len(encoded["images"]) == 1 and len(encoded["prompt_positions"]) == 3
    r = complete(encoded)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want
    r = complete(encode("shm"))
    assert r.status_code == 400 and "shm handles are not accepted" in r.text
    r = complete(encode("bytes"), prompt + " ")
    assert r.status_code == 400 and "prompt differs" in r.text
    # the server contacted no address a client named (bytes handles' producers hold
    # nothing; they and the refused shared-memory one are reclaimed at the lease)
    after = httpx.get(enc.url + "/stats").json()["ledger"]
    assert (after["opened"], after["released"]) == (before["opened"], before["released"])
    assert after["exported"] == before["exported"] + 3
    # none released: live still, or reclaimed at the fixture's 20 s lease (a loaded machine
    # can take that long between the two looks, for these or earlier tests' handles)
    assert (after["live_handles"] + after["reclaimed"]
            == before["live_handles"] + before["reclaimed"] + 3)


def test_epd_with_llava_next_tiles(vlmserve_cache) -> None:
    """LLaVA-NeXT through an encoder server: each image a stack of tiles (different counts),
    answers equal one process's. Then SIGKILL of the encoder server's HTTP process alone: its
    core follows it."""
    model = "tiny-llava-next"
    enc = ServeProc("--role", "encoder", model=model)
    try:
        llm = ServeProc("--encoder-url", enc.url, "--served-model-name", MODEL,
                        model=model)  # the name _stream sends
    except BaseException:
        enc.kill()
        raise
    try:
        urls = [data_url(make_image(w, h, i)) for i, (w, h) in enumerate([(56, 56), (120, 50),
                                                                          (50, 150)])]
        convs = [user("Describe.", urls[0]), user("Compare.", urls[1], urls[2])]
        assert _streamed_together(llm, convs, 8) == _single_process(convs, 8, model)
        assert httpx.get(enc.url + "/stats").json()["encoded_images"] == 3
        assert llm.stats()["encoder_handles_opened"] == 3
        llm.kill()
        core = enc.stats()["core_pid"]
        os.kill(enc.proc.pid, signal.SIGKILL)
        assert wait_until(lambda: not _alive(core), 5)
    finally:
        llm.kill()
        enc.kill()


def test_encoder_server_keys_and_body_limits(vlmserve_cache) -> None:
    """`--api-key` guards /v1/encode, /stats and the schema (401 without it; /health and
    /metrics stay open), and a body over `--max-request-bytes` is a 413 before it is read, as
    on the LLM server; an LLM server whose pixels it refuses answers its client with a 503,
    not a 400."""
    enc = ServeProc("--role", "encoder", "--api-key", "sesame", "--max-request-bytes", "200000")
    try:
        body = {"images": [data_url(make_image(56, 56, 5))], "transport": "bytes"}
        r = httpx.post(enc.url + "/v1/encode", json=body, timeout=60)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        r = httpx.post(enc.url + "/v1/encode", json=body, timeout=60,
                       headers={"authorization": "Bearer sesame"})
        assert r.status_code == 200, r.text
        for path in ("/stats", "/docs", "/openapi.json"):  # the server's internals too
            assert httpx.get(enc.url + path).status_code == 401, path
            assert httpx.get(enc.url + path, headers={"authorization": "Bearer sesame"}
                             ).status_code == 200, path
        for path in ("/health", "/metrics"):
            assert httpx.get(enc.url + path).status_code == 200, path
        big = {"images": [data_url(make_image(400, 400, 6))], "transport": "bytes"}
        r = httpx.post(enc.url + "/v1/encode", json=big, timeout=60,
                       headers={"authorization": "Bearer sesame"})
        assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]
        assert httpx.get(enc.url + "/health").status_code == 200
        # an LLM server with the key is served; one without it is told why (503)
        for key, status in [("sesame", 200), ("wrong", 503)]:
            llm = ServeProc("--encoder-url", enc.url, "--encoder-api-key", key)
            try:
                r = httpx.post(llm.url + "/v1/chat/completions", timeout=60, json={
                    "model": MODEL, "messages": user("Hi.", data_url(make_image(56, 84, key
                                                                                == "wrong"))),
                    "max_tokens": 2})
                assert r.status_code == status, r.text
                if key == "sesame":  # the encoder server's lower body limit refuses this
                    # server's pixels: a 503 naming it (the user's request was fine)
                    r = httpx.post(llm.url + "/v1/chat/completions", timeout=60, json={
                        "model": MODEL, "messages": user("Hi.", data_url(make_image(
                            400, 400, 7))), "max_tokens": 2})
                    message = r.json()["error"]["message"]
                    assert r.status_code == 503 and "HTTP 413" in message, r.text
            finally:
                llm.kill()
    finally:
        enc.kill()


def test_requests_wait_for_encoders_side_by_side_not_in_the_preprocessing_pool(epd) -> None:
    """With one preprocessing process, requests still wait for the encoder server together:
    the wait is on the front end's threads (a proxy that holds each encode until three are
    in flight at once), and the answers are a single process's."""
    import http.server
    import threading

    enc, _ = epd
    state = {"now": 0, "most": 0}
    together = threading.Condition()

    class SlowProxy(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["content-length"]))
            with together:
                state["now"] += 1
                state["most"] = max(state["most"], state["now"])
                together.notify_all()
                # sent one by one, they would meet here only at the deadline (and fail)
                together.wait_for(lambda: state["most"] >= 3, timeout=30)
            r = httpx.post(enc.url + self.path, content=body, timeout=30,
                           headers={k: v for k, v in self.headers.items()
                                    if k.lower() in ("content-type", "accept")})
            with together:
                state["now"] -= 1
            self.send_response(r.status_code)
            self.send_header("content-type", r.headers["content-type"])
            self.send_header("content-length", str(len(r.content)))
            self.end_headers()
            self.wfile.write(r.content)

        def log_message(self, *args) -> None:
            pass

    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowProxy)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    llm = ServeProc("--encoder-url", f"http://127.0.0.1:{proxy.server_port}",
                    "--preprocess-workers", "1")
    try:
        convs = [user("Describe.", data_url(make_image(56 + 28 * i, 56, 40 + i)))
                 for i in range(4)]
        assert _streamed_together(llm, convs, 6) == _single_process(convs, 6)
        assert state["most"] >= 3, state
        core = llm.stats()
        assert core["encoder_handles_opened"] == core["encoder_handles_released"] == 4
    finally:
        llm.kill()
        proxy.shutdown()


def test_n_choices_through_the_encoder_server(epd) -> None:
    """`n` with encoder servers: the prompt is preprocessed once, each choice's message goes
    to the encoder on its own (a handle is opened once), every choice answers as a single
    process does."""
    enc, llm = epd
    conv = user("Describe.", data_url(make_image(70, 84, 50)))
    (want,) = _single_process([conv], 6)

    async def ask():
        async with llm.client() as client:
            return await client.chat.completions.create(
                model=MODEL, messages=conv, max_tokens=6, temperature=0, n=3,
                extra_body={"ignore_eos": True})

    resp = asyncio.run(ask())
    assert [c.message.content for c in resp.choices] == [want] * 3
    assert wait_until(lambda: httpx.get(enc.url + "/stats").json()["ledger"]["live_handles"]
                      == 0, 10)
    core = llm.stats()
    assert core["encoder_handles_opened"] == core["encoder_handles_released"]
    assert core["encoder_handles_live"] == 0


def _encode_body() -> dict:
    return {"images": [data_url(IMAGES[0])], "transport": "bytes"}


def test_encoder_server_stops_cleanly_and_never_leaves_its_core(vlmserve_cache) -> None:
    """SIGTERM: exit 0, the core gone with every handle reclaimed (no segment left). (SIGKILL
    of the HTTP process alone: `test_epd_with_llava_next_tiles`.)"""
    enc = ServeProc("--role", "encoder", "--encoder-lease", "600")
    try:
        r = httpx.post(enc.url + "/v1/encode", json={**_encode_body(), "transport": "shm"},
                       timeout=60)  # a handle nobody opens: live until the core stops
        assert r.is_success and enc.stats()["ledger"]["live_handles"] == 1
        core = enc.stats()["core_pid"]
        assert len(segments(f"vlms-{core}x")) == 1
        os.kill(enc.proc.pid, signal.SIGTERM)
        assert enc.wait(30) == 0
        assert wait_until(lambda: not _alive(core), 5)
        assert segments(f"vlms-{core}x") == []
    finally:
        enc.kill()


def test_two_encoder_front_ends_share_one_core(vlmserve_cache) -> None:
    """`--role encoder --api-server-count 2`: two HTTP front ends on one port over one
    encoder core; an LLM server through it answers as one process does; `/stats` counts the
    requests of both front ends, whichever answers it. The tower runs in a process of its own
    (not on an HTTP server's interpreter): when it dies, /health and /v1/encode answer 503
    naming it, and the whole encoder server exits 1 within 5 s."""
    enc = ServeProc("--role", "encoder", "--api-server-count", "2")
    try:
        llm = ServeProc("--encoder-url", enc.url)
        try:
            convs = _conversations()
            assert _streamed_together(llm, convs, 8) == _single_process(convs, 8)
            stats = enc.stats()
            assert stats["encoded_images"] == 3 and stats["server"]["jobs"] >= 2
            assert wait_until(lambda: enc.stats()["ledger"]["live_handles"] == 0, 10)
            for _ in range(6):  # a connection each: the kernel spreads them over the two
                with httpx.Client(timeout=60) as fresh:
                    assert fresh.post(enc.url + "/v1/encode", json=_encode_body()).is_success
            sent = llm.stats()["encoder_client"]["posts"] + 6
            for _ in range(6):
                with httpx.Client(timeout=10) as fresh:
                    assert fresh.get(enc.url + "/stats").json()["server"]["requests"] == sent
        finally:
            llm.kill()
        core = stats["core_pid"]
        assert core != enc.proc.pid and _alive(core)
        exited_at: list[float] = []  # taken by a thread of its own: the polls below may block
        waiter = threading.Thread(target=lambda: (enc.proc.wait(70),
                                                  exited_at.append(time.monotonic())),
                                  daemon=True)
        os.kill(core, signal.SIGKILL)
        killed, seen = time.monotonic(), set()
        waiter.start()
        while not exited_at and time.monotonic() < killed + 60:  # 60: a hang
            try:
                if httpx.get(enc.url + "/health", timeout=1).status_code == 503:
                    seen.add("health")
                    r = httpx.post(enc.url + "/v1/encode", json=_encode_body(), timeout=5)
                    assert r.status_code == 503, r.text
                    assert "encoder core" in r.json()["error"]["message"]
                    seen.add("encode")
            except httpx.TransportError:  # it is closing
                pass
            time.sleep(0.05)
        waiter.join(10)
        assert enc.proc.returncode == 1 and exited_at and exited_at[0] - killed < 5
        assert seen == {"health", "encode"}
    finally:
        enc.kill()


def test_a_video_through_the_encoder_server(epd) -> None:
    """A video_url part: the LLM server's preprocessing samples and resizes the frames, the
    encoder server encodes them in temporal patches; the text equals one process's."""
    enc, llm = epd
    url = "data:video/mp4;base64," + base64.b64encode(make_mp4()).decode()
    conv = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                          {"type": "text", "text": "What happens?"}]}]
    before = enc.stats()["encoded_images"]
    assert _streamed_together(llm, [conv], 8) == _single_process([conv], 8)
    assert enc.stats()["encoded_images"] == before + 1
