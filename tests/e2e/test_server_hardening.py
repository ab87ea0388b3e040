"""No request can hurt the server (issue 21): each finding of the probe, reproduced against a
real `vlmserve serve` process on the tiny model; after each, `/health` is 200 and a normal
chat request is answered."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_server_procs import MODEL, ServeProc

FAULTS = str(Path(__file__).parent / "fault_injection")
POISON_SEED = 4242  # the sampler raises for this seed
STALL_SEED = 4343  # never scheduled
STALL_S = 5
HANG = "HANGS-FOR-EVER"  # a grammar holding this compiles for ever
COMPILE_S = 2  # --grammar-compile-timeout
CONNECTIONS = 32  # --limit-concurrency
HEADER_S = 3  # --request-header-timeout


@pytest.fixture(scope="module")
def srv(vlmserve_cache: Path):
    path = os.pathsep.join(p for p in (FAULTS, os.environ.get("PYTHONPATH")) if p)
    proc = ServeProc("--max-prompt-chars", "20000", "--request-body-timeout", "2",
                     "--health-stall-timeout", str(STALL_S),
                     "--grammar-compile-timeout", str(COMPILE_S),
                     "--limit-concurrency", str(CONNECTIONS),
                     "--request-header-timeout", str(HEADER_S),
                     env={"PYTHONPATH": path, "VLMSERVE_POISON_SEED": str(POISON_SEED),
                          "VLMSERVE_STALL_SEED": str(STALL_SEED),
                          "VLMSERVE_GRAMMAR_HANG": HANG})
    yield proc
    proc.kill()


def chat_body(**kw) -> dict:
    # ignore_eos: every answer has max_tokens tokens (sampled, the tiny model may end early)
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hello there."}],
            "max_tokens": 4, "ignore_eos": True, **kw}


def post(srv: ServeProc, body: dict | bytes, path: str = "/v1/chat/completions",
         timeout: float = 60) -> httpx.Response:
    if isinstance(body, dict):
        return httpx.post(srv.url + path, json=body, timeout=timeout)
    return httpx.post(srv.url + path, content=body, timeout=timeout,
                      headers={"content-type": "application/json"})


def assert_serving(srv: ServeProc) -> None:
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    r = post(srv, chat_body(temperature=0))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"


def assert_400(r: httpx.Response, *words: str) -> None:
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    for w in words:
        assert w in message, message


# finding 1: values that passed the range checks and raised inside the engine step
@pytest.mark.parametrize("kw", [{"seed": 2**70}, {"seed": -(2**63) - 1}, {"seed": 2**64}])
def test_seed_outside_64_bits_is_a_400(srv, kw) -> None:
    assert_400(post(srv, chat_body(**kw)), "seed", "64-bit")
    assert_serving(srv)


@pytest.mark.parametrize("kw", [{"temperature": 1e-40}, {"temperature": 5e-324},
                                {"top_p": 1e-46}, {"top_p": 1e-40, "temperature": 1.0},
                                {"seed": 2**64 - 1, "temperature": 0.5}, {"seed": -1}])
def test_edge_values_the_kernels_take_are_served(srv, kw) -> None:
    r = post(srv, chat_body(**kw))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert_serving(srv)


def test_a_request_that_fails_in_a_step_fails_alone(srv) -> None:
    """A fault inside the engine step (injected into the sampler for one seed) fails that
    request (500 / an error event) while concurrent streams finish untouched."""

    async def run() -> tuple[list[str], httpx.Response, list[str]]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
            async def stream(**kw) -> list[str]:
                body = chat_body(stream=True, max_tokens=24, ignore_eos=True,
                                 stream_options={"include_usage": True},
                                 **{"temperature": 0, **kw})
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    return [line async for line in r.aiter_lines() if line]

            good = [asyncio.create_task(stream()) for _ in range(6)]
            await asyncio.sleep(0.3)
            bad = client.post("/v1/chat/completions",
                              json=chat_body(seed=POISON_SEED, temperature=1.0))
            bad_stream = stream(seed=POISON_SEED, temperature=1.0)
            r, events = await asyncio.gather(bad, bad_stream)
            return [await g for g in good], r, events

    goods, bad, bad_events = asyncio.run(run())
    assert bad.status_code == 500, bad.text
    assert "failed in the engine" in bad.json()["error"]["message"]
    assert "failed in the engine" in bad_events[-2] and bad_events[-1] == "data: [DONE]"
    for events in goods:
        assert events[-1] == "data: [DONE]"
        finish = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]
                  if json.loads(e[6:])["choices"]]
        # all 24 tokens (in up to 24 chunks: fewer when the reader falls behind) + the finish
        assert finish[-1] == "length" and 2 <= len(finish) <= 25
        assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 24
    assert_serving(srv)
    s = srv.stats()
    assert s["num_running"] == s["num_waiting"] == 0
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"]


# finding 2: 500s for input errors
@pytest.mark.parametrize("raw", [
    b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}',
    b'{"model": "\\udc00", "messages": [{"role": "user", "content": "hi"}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": '
    b'{"url": "/tmp/\\ud800.png"}}]}]}',
])
def test_lone_surrogates_are_a_400(srv, raw) -> None:
    assert_400(post(srv, raw), "surrogate")
    assert_serving(srv)


def test_json_nested_50000_deep_is_a_400(srv) -> None:
    raw = b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    assert_400(post(srv, raw), "nested too deeply")
    assert_serving(srv)


# finding 3: accepted and ignored, or silently coerced
@pytest.mark.parametrize("kw, words", [
    ({"response_format": {"type": "xml"}}, ["response_format", "json_schema"]),
    ({"response_format": {"type": "json_schema"}}, ["json_schema", "needs"]),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"},
     ["at most one", "response_format", "guided_regex"]),
    ({"structured_outputs": {"regex": "(unclosed"}}, ["invalid regex"]),
    ({"structured_outputs": {"json": {"type": "no-such-type"}}}, ["invalid json"]),
    ({"structured_outputs": {"xml": "a"}}, ["structured_outputs", "xml"]),
    ({"tool_choice": "auto"}, ["tool_choice", "needs tools"]),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, ["auto", "parser"]),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, ["'g'", "not among"]),
    ({"tool_choice": "required"}, ["needs tools"]),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, ["cannot be combined"]),
    ({"functions": [{"name": "f"}]}, ["functions", "not supported"]),
    ({"logprobs": True, "top_logprobs": 21}, ["top_logprobs", "less than or equal to 20"]),
    ({"frequency_penalty": 2.5}, ["frequency_penalty", "[-2, 2]"]),
    ({"logit_bias": {"x": 1}}, ["logit_bias", "token ids"]),
    ({"logit_bias": {"99999999": 1}}, ["logit_bias", "vocabulary"]),
    ({"repetition_penalty": 0}, ["repetition_penalty"]),
    ({"max_tokens": True}, ["max_tokens", "integer"]),
    ({"max_tokens": 2.5}, ["max_tokens", "integer"]),
    ({"stream": "yes"}, ["stream", "boolean"]),
    ({"temperature": "0.5"}, ["temperature", "number"]),
    ({"seed": 1.5}, ["seed", "integer"]),
    ({"no_such_argument": 1}, ["no_such_argument", "unrecognized"]),
])
def test_unsupported_fields_and_loose_types_are_a_400(srv, kw, words) -> None:
    r = post(srv, chat_body(**kw))
    assert_400(r, *words)
    assert_serving(srv)


@pytest.mark.parametrize("kw", [
    {"response_format": {"type": "text"}}, {"tool_choice": "none"}, {"tools": []},
    {"logprobs": False}, {"frequency_penalty": 0.0}, {"presence_penalty": 0},
    {"user": "u1", "metadata": {"k": "v"}, "store": False, "parallel_tool_calls": True},
])
def test_fields_set_to_what_asks_for_nothing_are_accepted(srv, kw) -> None:
    assert post(srv, chat_body(**kw)).status_code == 200


# finding 4: one request stalls everyone
def test_a_10_mb_prompt_is_refused_before_tokenizing(srv) -> None:
    start = time.monotonic()
    r = post(srv, chat_body(messages=[{"role": "user", "content": "word " * 2_000_000}]))
    assert_400(r, "characters", "--max-prompt-chars")
    r = post(srv, {"model": MODEL, "prompt": "x" * 10_000_000, "max_tokens": 2},
             path="/v1/completions")
    assert_400(r, "characters")
    assert time.monotonic() - start < 20
    assert_serving(srv)


# finding 9: max_tokens beyond the context is a 400 (as vLLM's), an absent one fills it
def test_max_tokens_that_cannot_fit_is_a_400(srv) -> None:
    assert_400(post(srv, chat_body(max_tokens=5000)), "max_tokens", "at most")
    r = post(srv, {"model": MODEL, "prompt": [1] * 1000, "temperature": 0,
                   "ignore_eos": True}, path="/v1/completions")
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["total_tokens"] == 1024  # to the context length
    assert_serving(srv)


def test_a_body_that_never_arrives_gets_a_408(srv) -> None:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
        reply = b""
        while b"}}" not in reply:  # the error body, maybe in a later segment
            chunk = s.recv(4096)
            assert chunk, reply
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert b"--request-body-timeout" in reply
    assert_serving(srv)


# finding 6: a KV cache smaller than one request's prompt + max_tokens livelocked
def test_a_kv_cache_smaller_than_the_context_cannot_livelock(vlmserve_cache) -> None:
    small = ServeProc("--num-kv-blocks", "16", "--block-size", "16")  # 256 tokens of 1024
    try:
        models = httpx.get(small.url + "/v1/models").json()
        assert models["data"][0]["max_model_len"] == 256
        assert_400(post(small, chat_body(max_tokens=400)), "max_tokens", "256")
        start = time.monotonic()
        r = post(small, chat_body(max_tokens=None, temperature=0, ignore_eos=True))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["total_tokens"] == 256
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert time.monotonic() - start < 60
        assert small.stats()["num_preemptions"] == 0
        assert_serving(small)
    finally:
        small.kill()


def test_a_grammar_past_its_compile_deadline_fails_its_request_alone(srv) -> None:
    """Its compile process is ended at the deadline; the request gets a 400 naming the option
    (streamed: an error event, then [DONE]); another structured request is answered while it
    compiles."""
    url = srv.url + "/v1/chat/completions"
    hang = chat_body(structured_outputs={"regex": HANG})
    ok = chat_body(structured_outputs={"choice": ["ok"]}, temperature=0, ignore_eos=False)

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(client.post(url, json=hang), client.post(url, json=ok))

    hung, answered = asyncio.run(both())
    assert_400(hung, f"within {COMPILE_S} s (--grammar-compile-timeout)")
    assert answered.status_code == 200, answered.text
    assert answered.json()["choices"][0]["message"]["content"] == "ok"
    with httpx.stream("POST", url, json=hang | {"stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["type"] == "invalid_request_error" and lines[-1] == "data: [DONE]", lines
    assert "--grammar-compile-timeout" in error["message"]
    assert_serving(srv)


def test_idle_and_slow_header_connections_are_closed(srv) -> None:
    """Past --limit-concurrency a new connection closes the one idle longest, so normal
    requests are answered while the cap is full of idle connections; a connection that sends
    no request head, or sends it a byte at a time, is closed at --request-header-timeout."""
    import select

    def connect() -> socket.socket:
        return socket.create_connection(("127.0.0.1", srv.port), timeout=30)

    def wait_closed(s: socket.socket) -> None:
        """Read until the server closes (EOF, or a reset); fails at the socket's timeout."""
        with contextlib.suppress(ConnectionResetError):
            while s.recv(4096):
                pass

    idle = [connect() for _ in range(CONNECTIONS + 4)]
    for s in idle[:4]:  # the oldest made room for the newest
        wait_closed(s)
    assert_serving(srv)  # beside CONNECTIONS idle ones
    slow = connect()
    slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
    deadline = time.monotonic() + 30  # bounds a broken test only
    while not select.select([slow], [], [], 0.25)[0]:
        assert time.monotonic() < deadline, "the slow header was never cut"
        slow.sendall(b"X")
    wait_closed(slow)
    for s in idle:
        wait_closed(s)
    assert_serving(srv)


def test_health_reports_an_engine_that_makes_no_progress(srv) -> None:
    """A request the engine holds and never computes (injected) turns /health to 503 after
    --health-stall-timeout; once it goes, /health is 200 again."""

    async def run() -> tuple[int, str]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            stuck = asyncio.create_task(client.post(
                "/v1/chat/completions", json=chat_body(seed=STALL_SEED, temperature=1.0)))
            await asyncio.sleep(1)
            assert (await client.get("/health")).status_code == 200
            await asyncio.sleep(STALL_S + 1)
            r = await client.get("/health")
            stuck.cancel()  # the client goes: the request is aborted
            return r.status_code, r.text

    status, text = asyncio.run(run())
    assert status == 503 and "computed no token" in text
    deadline = time.monotonic() + 10
    while httpx.get(srv.url + "/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert_serving(srv)


def test_eight_8000x8000_pngs_are_refused_from_their_headers(srv) -> None:
    """Finding 4: one-colour 8000x8000 PNGs (small to send, 192 MB each to decode) are
    refused before any is decoded, quickly, and the server stays lean."""
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8000, 8000), (200, 30, 30)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}} for _ in range(8)]
    start = time.monotonic()
    r = post(srv, chat_body(messages=[{"role": "user", "content": content}]))
    assert_400(r, "8000x8000", "--max-image-pixels")
    assert time.monotonic() - start < 10
    assert_serving(srv)


def test_hermes_tool_calls_read_as_the_text_grows() -> None:
    """Calls in Qwen's format, fed in any pieces: the text around them is content (a tag's
    start at the end held back until it is known), each call whole when its tag closes, a
    tag without a call in it stays text, an unclosed call at the end still counts."""
    from vlmserve.entrypoints.openai.tool_calls import HermesCalls, auto_calls_of

    text = ('Let me check. <tool_call>\n{"name": "weather", "arguments": {"city": "Ro\\"me"}}'
            '\n</tool_call>\n<tool_call>not json</tool_call> <tool_call>{"name": "noop", '
            '"arguments": {}}')
    want_content = 'Let me check. \n<tool_call>not json</tool_call> '
    for step in (1, 3, 11, len(text)):
        calls, content, events = HermesCalls(), "", []
        for i in range(0, len(text), step):
            got, new = calls.feed(text[i:i + step])
            assert "<" not in got or "<tool_call>not" in content + got
            content, events = content + got, events + new
        got, new = calls.feed("", final=True)
        content, events = content + got, events + new
        assert content == want_content
        assert [(e["index"], e["function"]["name"], json.loads(e["function"]["arguments"]))
                for e in events] == [(0, "weather", {"city": 'Ro"me'}), (1, "noop", {})]
    content, found = auto_calls_of(text)
    assert content == want_content and [c.function.name for c in found] == ["weather", "noop"]
    assert auto_calls_of("<tool_call>{\"name\": \"f\"}</tool_call>")[0] is None  # calls only
    assert auto_calls_of("a < b <tool_") == ("a < b <tool_", [])


def test_required_tool_calls_stream_as_their_text_grows() -> None:
    """A "required" answer's text, fed in any pieces: each call's id and name once its head
    is complete, then its arguments exactly, escapes and nesting included."""
    from vlmserve.entrypoints.openai.tool_calls import RequiredCalls

    text = ('[{"name": "weather", "parameters": {"city": "Ro\\"m}e", "l": [1, {"a": 2}]}}, '
            '{"name": "noop", "parameters": {}}, {"name": "n\\u00e9", "parameters": 5}]')
    for step in (1, 2, 7, len(text)):
        calls, events = RequiredCalls(), []
        for i in range(0, len(text), step):
            events += calls.feed(text[i:i + step])
        names = [e["function"]["name"] for e in events if "id" in e]
        args: dict[int, str] = {}
        for e in events:
            args[e["index"]] = args.get(e["index"], "") + e["function"]["arguments"]
        assert names == ["weather", "noop", "n\u00e9"] and calls.count == calls.begun == 3
        assert args == {0: '{"city": "Ro\\"m}e", "l": [1, {"a": 2}]}', 1: "{}", 2: "5"}
    cut = RequiredCalls()
    assert cut.feed('[{"name": "wea') == [] and cut.begun == 0
    assert [e["function"] for e in cut.feed('ther", "parameters": {"a')] == [
        {"name": "weather", "arguments": ""}, {"arguments": '{"a'}]
    assert cut.begun == 1 and cut.count == 0  # begun, not complete
