"""Remote image fetching: only public addresses unless allowed, every hop re-checked, one
total deadline, a byte cap, one message for every failure, and a slow fetch that holds up no
other request (real HTTP servers on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import uvicorn
from PIL import Image

from tests.wait import wait_until
from vlmserve.config import EngineConfig
from vlmserve.entrypoints.args import engine_kwargs
from vlmserve.entrypoints.cli import make_parser
from vlmserve.entrypoints.openai.server import build_app
from vlmserve.errors import InvalidImageError
from vlmserve.frontend.async_llm import AsyncLLM
from vlmserve.multimodal.fetch import FetchPolicy, RemoteImageFetcher
from vlmserve.multimodal.image import RestrictedImageLoader, load_image


def png_bytes(size: tuple[int, int] = (40, 30), color: tuple = (200, 30, 60)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


PNG = png_bytes()


class Origin:
    """A test HTTP server on 127.0.0.1: /img.png, /redirect (to 127.0.0.1), /drip (a byte
    every 0.5 s, 1,000 of them), /drip?n=N&every=S (N bytes, one every S s), /hold (one byte
    of 1,000, then the connection closes once `release` is set), /endless (no Content-Length,
    10 MB; `endless_cut` is set when the client hung up before the end), anything else 404;
    `hits` lists the paths asked for."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        self.release = threading.Event()
        self.endless_cut = threading.Event()
        self.endless_done = threading.Event()
        origin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                origin.hits.append(self.path)
                if self.path == "/img.png":
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(len(PNG)))
                    self.end_headers()
                    self.wfile.write(PNG)
                elif self.path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", f"http://127.0.0.1:{origin.port}/img.png")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif self.path.split("?")[0] == "/drip":
                    query = dict(p.split("=") for p in self.path.partition("?")[2].split("&")
                                 if p)
                    n, every = int(query.get("n", 1000)), float(query.get("every", 0.5))
                    self.send_response(200)
                    self.send_header("Content-Length", str(n))
                    self.end_headers()
                    try:
                        for _ in range(n):
                            self.wfile.write(b"x")
                            self.wfile.flush()
                            time.sleep(every)
                    except OSError:
                        pass
                elif self.path == "/hold":
                    self.send_response(200)
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    try:
                        self.wfile.write(b"x")
                        self.wfile.flush()
                    except OSError:
                        pass
                    origin.release.wait(120)
                    self.close_connection = True
                elif self.path == "/endless":
                    self.send_response(200)
                    self.send_header("Connection", "close")
                    self.end_headers()
                    try:
                        for _ in range(160):
                            self.wfile.write(b"\0" * 65536)
                    except OSError:
                        origin.endless_cut.set()
                    origin.endless_done.set()
                    self.close_connection = True
                else:
                    self.send_error(404)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.block_on_close = False
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def origin() -> Iterator[Origin]:
    o = Origin()
    yield o
    o.close()


def fetch(url: str, **policy) -> bytes:
    fetcher = RemoteImageFetcher(FetchPolicy(**policy), workers=2)
    try:
        return asyncio.run(fetcher.fetch(url, 1))
    finally:
        fetcher.close()


@pytest.fixture
def requests_sent(monkeypatch) -> dict:
    """Counts the HTTP requests the fetcher makes (`httpx.AsyncClient.stream`): all of them,
    and the most in flight at once."""
    counts = {"all": 0, "now": 0, "most": 0}
    real = httpx.AsyncClient.stream

    @contextlib.asynccontextmanager
    async def stream(self, *args, **kwargs):
        counts["all"] += 1
        counts["now"] += 1
        counts["most"] = max(counts["most"], counts["now"])
        try:
            async with real(self, *args, **kwargs) as response:
                yield response
        finally:
            counts["now"] -= 1

    monkeypatch.setattr(httpx.AsyncClient, "stream", stream)
    return counts


def fetch_error(url: str, **policy) -> str:
    with pytest.raises(InvalidImageError) as e:
        fetch(url, **policy)
    return str(e.value)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_loopback_refused_with_the_same_message_as_any_failure(origin: Origin) -> None:
    """A blocked address, a refused connection, a deadline and a 404 read the same, so a
    client cannot scan ports through the server; the blocked one never connects."""
    blocked = origin.url("/img.png")
    hits = len(origin.hits)
    assert fetch_error(blocked) == f"could not fetch image 1: {blocked}"
    assert len(origin.hits) == hits, "a refused address was connected to"
    allow = {"allowed_hosts": ("127.0.0.1",)}
    refused = f"http://127.0.0.1:{closed_port()}/img.png"
    assert fetch_error(refused, **allow) == f"could not fetch image 1: {refused}"
    missing = origin.url("/missing.png")
    assert fetch_error(missing, **allow) == f"could not fetch image 1: {missing}"
    slow = origin.url("/drip")
    assert fetch_error(slow, timeout=0.3, **allow) == f"could not fetch image 1: {slow}"
    with socket.socket() as listener:  # accepts, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        silent = f"http://127.0.0.1:{listener.getsockname()[1]}/x.png"
        assert fetch_error(silent, timeout=0.3, **allow) == f"could not fetch image 1: {silent}"


@pytest.mark.parametrize("host", ["2130706433", "0x7f000001", "0177.0.0.1", "127.1",
                                  "[::ffff:127.0.0.1]", "localhost", "LOCALHOST."])
def test_numeric_and_named_loopback_forms_refused(origin: Origin, host: str) -> None:
    hits = len(origin.hits)
    url = origin.url("/img.png", host)
    assert fetch_error(url) == f"could not fetch image 1: {url}"
    assert len(origin.hits) == hits


@pytest.mark.parametrize("url", ["http://10.0.0.1/x.png", "http://169.254.169.254/latest/",
                                 "http://[::1]/x.png", "http://[fe80::1]/x.png",
                                 "http://0.0.0.0/x.png", "http://224.0.0.1/x.png",
                                 "ftp://example.com/x.png", "http://user:pw@127.0.0.1/x.png"])
def test_other_non_public_targets_refused(url: str, requests_sent: dict) -> None:
    assert fetch_error(url, timeout=5) == f"could not fetch image 1: {url}"
    assert requests_sent["all"] == 0, "refused before any connection attempt"


def test_redirect_to_a_blocked_address_refused(origin: Origin) -> None:
    """The first hop is allowed by its name; the redirect goes to 127.0.0.1, which that
    name does not cover, and is refused before it is asked."""
    start = origin.url("/redirect", "localhost")
    before = list(origin.hits)
    assert fetch_error(start, allowed_hosts=("localhost",)) == f"could not fetch image 1: {start}"
    assert origin.hits[len(before):] == ["/redirect"]
    # allowed for both hops, the redirect is followed
    assert fetch(start, allowed_hosts=("localhost", "127.0.0.1")) == PNG
    assert fetch_error(start, allowed_hosts=("localhost", "127.0.0.1"), max_redirects=0)


def test_allowed_hosts_fetch_end_to_end(origin: Origin) -> None:
    for allowed in ["127.0.0.1", "127.0.0.0/8", "localhost"]:
        host = "localhost" if allowed == "localhost" else "127.0.0.1"
        hosts = FetchPolicy.parse_hosts(f" {allowed} , example.com")
        assert fetch(origin.url("/img.png", host), allowed_hosts=hosts) == PNG
    data = fetch(origin.url("/img.png"), allowed_hosts=("127.0.0.1",))
    image = RestrictedImageLoader(max_pixels=10_000).load_all([data])[0]
    assert image.size == (40, 30) and image.getpixel((0, 0)) == (200, 30, 60)


def test_offline_load_image_fetches_the_same_way(origin: Origin) -> None:
    url = origin.url("/img.png")
    with pytest.raises(InvalidImageError, match="could not fetch image"):
        load_image(url, allow_remote=True)
    image = load_image(url, allow_remote=True, allowed_remote_hosts=["127.0.0.1"])
    assert image.size == (40, 30)


def test_total_deadline_cuts_a_dripping_body(origin: Origin) -> None:
    """One byte every 0.1 s never trips a per-read timeout; the body takes 4 s or more to
    arrive whole, so only the total deadline of 1.5 s can end it with an error."""
    allow = {"allowed_hosts": ("127.0.0.1",)}
    assert fetch(origin.url("/drip?n=3&every=0.1"), timeout=60, **allow) == b"xxx"
    fetch_error(origin.url("/drip?n=40&every=0.1"), timeout=1.5, **allow)


def test_byte_cap(origin: Origin) -> None:
    allow = {"allowed_hosts": ("127.0.0.1",)}
    assert fetch(origin.url("/img.png"), max_bytes=len(PNG), **allow) == PNG
    fetch_error(origin.url("/img.png"), max_bytes=len(PNG) - 1, **allow)  # Content-Length
    # no Content-Length: cut while reading (the origin sees the client hang up), not after
    # all 10 MB
    fetch_error(origin.url("/endless"), max_bytes=100_000, **allow)
    assert wait_until(origin.endless_done.is_set)
    assert origin.endless_cut.is_set()


def test_fetches_run_at_most_workers_at_once(origin: Origin, requests_sent: dict) -> None:
    """Four dripping fetches, two workers: two at a time, and the deadline of each starts
    when it gets a worker (all four reach the origin before their deadline ends them)."""
    fetcher = RemoteImageFetcher(FetchPolicy(timeout=0.6, allowed_hosts=("127.0.0.1",)), 2)

    async def run() -> list:
        return await asyncio.gather(*[fetcher.fetch(origin.url("/drip"), i)
                                      for i in range(4)], return_exceptions=True)

    try:
        results = asyncio.run(run())
    finally:
        fetcher.close()
    assert all(isinstance(r, InvalidImageError) for r in results)
    assert (requests_sent["all"], requests_sent["most"]) == (4, 2)


# ---- through the server -------------------------------------------------------------------

MODEL = "tiny-qwen2-vl"
ENGINE_FLAGS = ["--dtype", "float32", "--device", "cpu", "--max-model-len", "1024",
                "--max-num-batched-tokens", "256", "--host", "127.0.0.1"]


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat_body(text: str, *urls: str) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]}


def test_a_slow_fetch_does_not_delay_other_requests(vlmserve_cache: Path,
                                                    origin: Origin) -> None:
    """With one preprocessing process, a request whose image is still arriving (the origin
    holds it until told) does not hold up a request with an inline image, which is answered
    first; an allowed remote image is fetched and answered; the server's 400s for a blocked
    and a failed fetch read the same; the fetch flags reach the server's fetcher."""
    args = make_parser().parse_args([
        "serve", MODEL, *ENGINE_FLAGS, "--allow-remote-images", "--allowed-remote-hosts",
        "localhost", "--remote-image-timeout", "120", "--remote-image-fetch-workers", "2"])
    engine = AsyncLLM(EngineConfig.from_kwargs(**engine_kwargs(args) | {"model": MODEL}),
                      preprocess_workers=1)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/chat/completions"
    app = build_app(engine, args)
    fetcher = app.state.serving.fetcher
    assert (fetcher.policy.timeout, fetcher.policy.allowed_hosts, fetcher.workers) == (
        120.0, ("localhost",), 2)
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            try:
                if httpx.get(url.replace("/v1/chat/completions", "/health")).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        r = httpx.post(url, json=chat_body("What is this?", origin.url("/img.png", "localhost")),
                       timeout=60)
        assert r.status_code == 200, r.text
        inline = chat_body("And this?", data_url(png_bytes((56, 56))))
        with ThreadPoolExecutor(1) as pool:
            slow_url = origin.url("/hold", "localhost")
            origin.release.clear()
            slow = pool.submit(httpx.post, url, json=chat_body("Slow.", slow_url), timeout=120)
            assert wait_until(lambda: "/hold" in origin.hits)  # its fetch is under way
            try:
                r = httpx.post(url, json=inline, timeout=120)
                assert r.status_code == 200 and not slow.done()
            finally:
                origin.release.set()  # the held body ends short: that fetch fails
            r = slow.result()
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_image"
        assert r.json()["error"]["message"] == f"could not fetch image 1: {slow_url}"
        blocked = origin.url("/img.png")  # 127.0.0.1 itself is not allowed, only "localhost"
        r = httpx.post(url, json=chat_body("x", data_url(PNG), blocked), timeout=60)
        assert r.status_code == 400
        assert r.json()["error"]["message"] == f"could not fetch image 2: {blocked}"
    finally:
        srv.should_exit = True
        thread.join(10)
        engine.shutdown()
        sock.close()
