"""`vlmserve serve` as real processes on a loopback port: front ends and the engine core, their
failures and their shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import procs
from tests.e2e.test_server import data_url, greedy, user
from tests.engine.helpers import make_image
from tests.procs import group_alive as _group_alive
from tests.wait import wait_until
from vlmserve import LLM
from vlmserve.entrypoints.openai.launch import bind_sockets

MODEL = "tiny-qwen2-vl"
# test servers listen on loopback alone (the default host is every interface, as vLLM's)
FLAGS = ["--dtype", "float32", "--device", "cpu", "--max-model-len", "1024",
         "--max-num-batched-tokens", "256", "--log-level", "warning", "--host", "127.0.0.1",
         "--preprocess-workers", "0"]  # preprocessing in the front end's threads
# the production path where the test is about the server's processes: a pool process a front end
POOL = ("--preprocess-workers", "1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def wait_healthy(url: str, procs: list[subprocess.Popen], timeout: float = 180) -> None:
    """Until `url`'s /health answers 200; every process of `procs` must stay up meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a server process exited during start-up"
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError("the server did not come up")

class ServeProc:
    """`python -m vlmserve serve ...` in a process group of its own, killed with the test
    that started it (`tests/procs.py`)."""

    def __init__(self, *extra: str, env: dict[str, str] | None = None,
                 model: str = MODEL, stderr: Path | None = None) -> None:
        """``stderr``: a file for the server's standard error (else the test's)."""
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        with open(stderr, "wb") if stderr is not None else contextlib.nullcontext() as err:
            self.proc = procs.start(
                [sys.executable, "-m", "vlmserve", "serve", model, "--port", str(self.port),
                 *FLAGS, *extra], stdout=subprocess.DEVNULL,
                stderr=err, env=None if env is None else {**os.environ, **env})
        try:
            wait_healthy(self.url, [self.proc])
        except BaseException:  # a failed start, or Ctrl-C meanwhile: nothing left running
            self.kill()
            raise

    def client(self) -> openai.AsyncOpenAI:
        # a connect given a minute (the client's 5 s default): a test's event loop busy with
        # other streams on 2 loaded cores has let a connect that the kernel made time out
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                                  timeout=openai.Timeout(600, connect=60))

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats", timeout=10).json()

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL the server's whole process group (its engine core and front ends too)."""
        procs.kill_group(self.proc)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False




@pytest.fixture
def serve(vlmserve_cache: Path) -> Iterator:
    procs: list[ServeProc] = []

    def start(*extra: str, **kw) -> ServeProc:
        procs.append(ServeProc(*extra, **kw))
        return procs[-1]

    yield start
    for p in procs:
        p.kill()


async def _stream(client: openai.AsyncOpenAI, messages: list[dict], n: int,
                  events: list | None = None) -> str:
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=n, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    text = []
    async for c in stream:
        if events is not None:
            events.append(c)
        if c.choices:
            text.append(c.choices[0].delta.content or "")
    return "".join(text)


@pytest.fixture(scope="module")
def two_front_ends(vlmserve_cache: Path) -> Iterator[ServeProc]:
    """A server with two front ends, shared by the tests that leave it running."""
    srv = ServeProc("--api-server-count", "2", *POOL)
    yield srv
    srv.kill()


def test_two_front_ends_serve_64_concurrent_streams_like_llm_chat(two_front_ends) -> None:
    srv = two_front_ends
    convs = [user(f"Request {i}: what is this?" + " more" * (i % 4),
                  *[data_url(make_image(56 + 28 * (i % 3), 56 + 28 * j, 7 * i + j))
                    for j in range(i % 3)]) for i in range(64)]
    llm = LLM(MODEL, dtype="float32", device="cpu", max_model_len=1024,
              max_num_batched_tokens=256)
    expected = [o.outputs[0].text for o in llm.chat(convs, greedy(16), use_tqdm=False)]

    async def run_all() -> list[str]:
        async with srv.client() as client:
            return await asyncio.gather(*(_stream(client, m, 16) for m in convs))

    assert asyncio.run(run_all()) == expected
    pids = set()
    for _ in range(60):  # a new connection each: the kernel hands them to both processes
        pids.add(httpx.get(srv.url + "/stats").json()["frontend_pid"])
        if len(pids) == 2:
            break
    assert len(pids) == 2, "both front ends accept connections"
    # n choices through a preprocessing process: one image preprocessed, three requests
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "messages": convs[2], "max_tokens": 16, "temperature": 0, "n": 3,
        "ignore_eos": True}).json()
    assert [c["message"]["content"] for c in r["choices"]] == [expected[2]] * 3
    s = srv.stats()
    assert s["num_running"] == s["num_waiting"] == 0
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"]


def _on_one_connection(srv: ServeProc, method: str, path: str, **kw: object
                       ) -> tuple[int, httpx.Response]:
    """One request on a new keep-alive connection, with `/stats` before and after it on the
    same connection: the pid of the front end that answered it, and its response."""
    with httpx.Client(base_url=srv.url, timeout=60,
                      limits=httpx.Limits(max_connections=1)) as c:
        pid = c.get("/stats").json()["frontend_pid"]
        r = c.request(method, path, **kw)
        assert c.get("/stats").json()["frontend_pid"] == pid, "the connection was kept"
    r.raise_for_status()
    return pid, r


_COUNTS = ("vlmserve_requests_finished_total{finish_reason=length}",
           "vlmserve_time_to_first_token_seconds_count",
           "vlmserve_e2e_request_latency_seconds_count")


def _samples(text: str) -> tuple[list, dict[str, float]]:
    """A scrape's samples, and their values by name and labels."""
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    return samples, {s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())):
                     s.value for s in samples}


def test_two_front_ends_metrics_count_every_front_ends_requests(two_front_ends) -> None:
    srv = two_front_ends
    assert wait_until(lambda: srv.stats()["num_running"] == srv.stats()["num_waiting"] == 0)
    _, counts = _samples(httpx.get(srv.url + "/metrics", timeout=60).text)
    before = {k: counts.get(k, 0.0) for k in _COUNTS}  # the module's earlier requests
    served: dict[int, int] = {}
    for i in range(80):  # a new connection each, until both front ends have served some
        if sum(served.values()) >= 12 and len(served) == 2:
            break
        images = [data_url(make_image(56, 56 + 28 * (i % 2), i))] if i % 3 == 0 else []
        pid, r = _on_one_connection(srv, "POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": user(f"Request {i}.", *images), "max_tokens": 4,
            "temperature": 0, "ignore_eos": True})
        assert r.json()["choices"][0]["finish_reason"] == "length"
        served[pid] = served.get(pid, 0) + 1
    assert len(served) == 2, "both front ends served requests"
    total = sum(served.values())
    scraped_by: set[int] = set()
    for _ in range(60):  # again a new connection each, until both front ends have answered
        if len(scraped_by) == 2 and _ >= 6:
            break
        pid, r = _on_one_connection(srv, "GET", "/metrics")
        scraped_by.add(pid)
        samples, by_key = _samples(r.text)
        # counters and histograms summed over both front ends, whichever one answers
        assert [by_key[k] - before[k] for k in _COUNTS] == [total] * 3
        # the engine core's gauges once (no per-process samples), its streams summed
        for name in ("vlmserve_num_requests_running", "vlmserve_num_requests_waiting",
                     "vlmserve_num_streams"):
            assert [(s.labels, s.value) for s in samples if s.name == name] == [({}, 0.0)]
    assert len(scraped_by) == 2, "both front ends answered scrapes"


@pytest.mark.parametrize("count", ["1", "2"])
def test_engine_core_killed_clients_told_health_503_and_exit_nonzero(serve, count) -> None:
    # 16,000 tokens: far more than the core makes before the kill, however late the client
    # reads its first events (900 were all made and buffered once on 2 busy cores)
    # one front end with its pool process, two without: every process ends either way
    srv = serve("--api-server-count", count, "--max-model-len", "16384",
                *(POOL if count == "1" else ()))
    core_pid = srv.stats()["engine_core_pid"]
    events: list = []
    polled: list[int] = []  # /health's statuses, as they come

    async def main() -> BaseException | str:
        async with srv.client() as client:
            task = asyncio.create_task(_stream(client, user("Talk."), 16000, events))
            while len(events) < 3 and not task.done():
                await asyncio.sleep(0.01)
            # /health polled from before the kill on: the front ends answer 503 for about a
            # second before they exit, a window that a poller started only after the kill
            # can miss on a loaded machine
            health = asyncio.create_task(asyncio.to_thread(_health_until_gone, srv.url,
                                                           statuses=polled))
            while not polled:
                await asyncio.sleep(0.01)
            os.kill(core_pid, signal.SIGKILL)
            # the deadline only turns a stream that is never told into a failure
            done = (await asyncio.gather(asyncio.wait_for(task, 60), return_exceptions=True))
            return done[0], await health

    result, statuses = asyncio.run(main())
    assert 503 in statuses and 200 not in statuses[statuses.index(503):], statuses
    # the stream ended with an error event (the openai client raises it) before [DONE]
    assert isinstance(result, openai.APIError) and "engine core" in str(result)
    # 1 s of 503s, then each process tears down (torch, preprocessing processes)
    assert srv.wait(60) not in (None, 0)


def _health_until_gone(url: str, timeout_s: float = 60,
                       statuses: list[int] | None = None) -> list[int]:
    """The statuses of `/health` asked over and over until the server stops answering (or
    the deadline), appended to `statuses` as they come."""
    statuses = [] if statuses is None else statuses
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            statuses.append(httpx.get(url + "/health", timeout=5).status_code)
        except httpx.HTTPError:
            break
        time.sleep(0.02)
    return statuses


async def _refuses_connections(url: str, timeout_s: float = 60) -> bool:
    """Whether a new request to `url` fails to connect (polled: the signal is handled
    asynchronously; a server that keeps answering fails at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            await asyncio.to_thread(httpx.post, url + "/v1/completions", json={"prompt": "x"},
                                    timeout=2)
        except httpx.HTTPError:
            return True
        await asyncio.sleep(0.05)
    return False


@pytest.mark.parametrize("count", ["1", "2"])
def test_sigterm_lets_streams_finish_ends_the_rest_and_exits_zero(serve, count,
                                                                   tmp_path) -> None:
    """... and quietly: no process of the server loaded Triton, which cannot run without a
    GPU (one that did prints about 60 lines of nanobind leak reports as it exits; the
    tests' TRITON_INTERPRET=1 would load it)."""
    # 6 s: the short streams' 20 tokens come well within it even on 2 busy cores; the long
    # ones' 16,000 cannot
    srv = serve("--shutdown-timeout", "6", "--max-model-len", "16384", "--api-server-count",
                count, *(POOL if count == "1" else ()), env={"TRITON_INTERPRET": "0"},
                stderr=tmp_path / "stderr")
    core_pid = srv.stats()["engine_core_pid"]
    events: list[list] = [[] for _ in range(8)]

    async def main() -> list:
        async with srv.client() as client:
            # four short streams finish within the timeout; four long ones cannot
            tasks = [asyncio.create_task(_stream(client, user(f"Stream {i}."),
                                                 20 if i < 4 else 16000, events[i]))
                     for i in range(8)]
            while min(len(e) for e in events) < 1:
                await asyncio.sleep(0.01)
            srv.proc.send_signal(signal.SIGTERM)
            assert await _refuses_connections(srv.url)  # no new requests
            return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, str) for r in results[:4])
    # all 20 tokens (a chunk each, or fewer chunks carrying several when the reader lags)
    assert all([c.choices[0].finish_reason for c in e if c.choices][-1] == "length"
               for e in events[:4])
    assert all(isinstance(r, openai.APIError) and "shutting down" in str(r)
               for r in results[4:])
    assert srv.wait(60) == 0
    assert wait_until(lambda: not _alive(core_pid))
    assert wait_until(lambda: not _group_alive(srv.proc.pid))  # every writer of its stderr
    log = (tmp_path / "stderr").read_text()
    assert "nanobind" not in log and "triton" not in log, log[-2000:]


def test_killing_the_front_end_leaves_no_engine_core(serve) -> None:
    srv = serve()
    core_pid = srv.stats()["engine_core_pid"]
    assert _alive(core_pid)
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(10)
    assert wait_until(lambda: not _alive(core_pid), step_s=0.05)


def test_port_in_use_fails_before_loading(tmp_path: Path) -> None:
    """The port is bound first: taken, the server exits with a clear message before it
    builds or loads the model (the built-in checkpoint never reaches its empty cache)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "vlmserve", "serve", MODEL, "--port",
                            str(port), *FLAGS], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "VLMSERVE_CACHE": str(tmp_path)})
    assert r.returncode != 0 and f"127.0.0.1:{port}" in r.stderr
    assert "Traceback" not in r.stderr
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())



def test_front_end_sockets_share_the_port_and_its_connections() -> None:
    """Each front end's own socket in one reuse-port group: new connections reach every one
    (one shared socket handed nearly all of them to one process), and the port stays ours."""
    socks = bind_sockets("127.0.0.1", 0, 3)
    port = socks[0].getsockname()[1]
    try:
        assert {s.getsockname()[1] for s in socks} == {port}
        seen = set()
        for _ in range(60):
            with socket.create_connection(("127.0.0.1", port)):
                ready, _, _ = select.select(socks, [], [], 5)
                for s in ready:
                    s.accept()[0].close()
                    seen.add(socks.index(s))
        assert seen == {0, 1, 2}
        for count in (1, 2):  # neither a plain server nor another group may join it
            with pytest.raises(SystemExit, match=f"127.0.0.1:{port}.*in use"):
                bind_sockets("127.0.0.1", port, count)
    finally:
        for s in socks:
            s.close()


def test_a_killed_tensor_parallel_rank_fails_the_stream_and_the_server_exits(serve) -> None:
    """`serve --tensor-parallel-size 2`, rank 1 killed with SIGKILL mid-stream: the stream
    ends with an error and the server exits non-zero (no hang in a collective)."""
    srv = serve("--tensor-parallel-size", "2")
    core_pid = srv.stats()["engine_core_pid"]
    children = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(core_pid)],
                              capture_output=True, text=True).stdout.splitlines()
    ranks = [int(line.split()[0]) for line in children if "spawn_main" in line]
    assert len(ranks) == 1, children
    events: list = []

    async def main() -> BaseException | str:
        async with srv.client() as client:
            task = asyncio.create_task(_stream(client, user("Talk."), 900, events))
            while len(events) < 3 and not task.done():
                await asyncio.sleep(0.01)
            os.kill(ranks[0], signal.SIGKILL)
            return (await asyncio.gather(task, return_exceptions=True))[0]

    result = asyncio.run(main())
    assert isinstance(result, openai.APIError), result
    assert srv.wait(60) not in (None, 0)  # the deadline: a hang
