"""No request can hurt the server (issue 21): each finding of the probe, reproduced against a
real `vlmserve serve` process on the tiny model; after each, `/health` is 200 and a normal
chat request is answered."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import os
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_server_procs import MODEL, ServeProc
from tests.wait import wait_until

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
    # shm handles from clients accepted (a trusted client's option): their checks are tested
    path = os.pathsep.join(p for p in (FAULTS, os.environ.get("PYTHONPATH")) if p)
    proc = ServeProc("--max-prompt-chars", "20000", "--request-body-timeout", "2",
                     "--health-stall-timeout", str(STALL_S),
                     "--accept-encoder-handles", "bytes,shm",
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
    """Refused by its length in characters (the limit the front end checks before the
    tokenizer runs: a tokenized prompt is refused in tokens), and the server serves on."""
    r = post(srv, chat_body(messages=[{"role": "user", "content": "word " * 2_000_000}]))
    assert_400(r, "characters", "--max-prompt-chars")
    r = post(srv, {"model": MODEL, "prompt": "x" * 10_000_000, "max_tokens": 2},
             path="/v1/completions")
    assert_400(r, "characters")
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
        # a livelock never answers: the client's deadline (120 s) fails the test
        r = post(small, chat_body(max_tokens=None, temperature=0, ignore_eos=True), timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["total_tokens"] == 256
        assert r.json()["choices"][0]["finish_reason"] == "length"
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
    """A request the engine holds and never computes (injected) turns /health to 503 once
    the engine's stall (its `stalled_s`) passes --health-stall-timeout, not before; once the
    request goes, /health is 200 again."""

    async def run() -> tuple[list, int, str]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            stuck = asyncio.create_task(client.post(
                "/v1/chat/completions", json=chat_body(seed=STALL_SEED, temperature=1.0)))
            under: list[int] = []  # /health's answers while the stall was under the limit
            deadline = time.monotonic() + 120  # only a hang reaches it
            while time.monotonic() < deadline:
                before = (await client.get("/stats")).json()["stalled_s"]
                health = await client.get("/health")
                after = (await client.get("/stats")).json()["stalled_s"]
                if 0 < after <= STALL_S:  # /health saw a stall of `before` to `after` s
                    under.append(health.status_code)
                elif before > STALL_S:  # and so was the stall /health saw
                    stuck.cancel()  # the client goes: the request is aborted
                    return under, health.status_code, health.text
                await asyncio.sleep(0.1)
            stuck.cancel()
            return under, 0, "no 503 while stalled"

    under, status, text = asyncio.run(run())
    assert under and set(under) == {200}, under
    assert status == 503 and "computed no token" in text, text
    assert wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, step_s=0.2)
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
    r = post(srv, chat_body(messages=[{"role": "user", "content": content}]))
    assert_400(r, "8000x8000", "--max-image-pixels")  # the header's size: none decoded
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


# ---- what a client sends is checked against what the server computes ------------------------


@functools.cache
def _model() -> tuple:
    """(input processor, image row width) of the served model, built here as the server's."""
    from vlmserve.models.metadata import load_model_processor
    from vlmserve.models.registry import image_row_width

    _, hf_config, processor = load_model_processor(MODEL)
    return processor, image_row_width(hf_config)


def _chat_text(messages: list[dict]) -> str:
    """The prompt text the server renders for these chat messages."""
    from vlmserve.inputs.chat import parse_chat_messages

    return _model()[0].apply_chat_template(parse_chat_messages(messages)[0])


PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe."
          "<|im_end|>\n<|im_start|>assistant\n")


def _rows_bytes(rows, name: str = "rows") -> str:
    from safetensors.torch import save

    return base64.b64encode(save({name: rows})).decode()


def encoded(images: list, text: str = PROMPT, rows: list | None = None) -> dict:
    """`multi_modal_embeddings` for ``text`` and ``images`` as an encoder server answers
    them, made here: the images' real content hashes, grids, offsets, lengths and the prompt's
    positions, with bytes handles of ``rows`` (default: random rows)."""
    import msgspec
    import torch

    from vlmserve.transfer.wire import BytesWire, output_to_wire

    processor, width = _model()
    processed = processor.process(text, None, images)
    handles = []
    for i, img in enumerate(processed.images):
        r = rows[i] if rows is not None else torch.randn(img.length, width)
        handles.append(BytesWire(handle_id=f"client-{i}", shape=tuple(r.shape), dtype="float32",
                                 release_address=None, expires_at=time.time() + 600,
                                 data=base64.b64decode(_rows_bytes(r))))
    return json.loads(msgspec.json.encode(output_to_wire(processed, handles)))


def complete(srv: ServeProc, mme: dict, text: str = PROMPT, **kw) -> httpx.Response:
    return post(srv, {"model": MODEL, "prompt": text, "max_tokens": 4, "temperature": 0,
                      "ignore_eos": True, "multi_modal_embeddings": mme, **kw},
                path="/v1/completions")


def test_client_embeddings_cannot_change_another_requests_answer(srv) -> None:
    """Rows a client plants under a real image's content hash (its recipe is public) are
    served to that client alone: a later ordinary request with that image, the same prompt
    (so the same prefix-cache keys, were the client's hash trusted), answers as a single
    process does."""
    import torch

    from tests.e2e.test_server import data_url, greedy, user
    from tests.engine.helpers import make_image
    from vlmserve import LLM

    image = make_image(84, 56, 4711)  # seen by no other request of this server
    conv = user("Describe.", data_url(image))
    ref = LLM(MODEL, dtype="float32", device="cpu", max_model_len=1024,
              max_num_batched_tokens=256)
    want = ref.chat([conv], greedy(8), use_tqdm=False)[0].outputs[0].text
    text = _chat_text(conv)
    planted = encoded([image], text, rows=[torch.full((6, _model()[1]), 30.0)])
    assert planted["images"][0]["length"] == 6
    r = complete(srv, planted, text, max_tokens=8)
    assert r.status_code == 200, r.text  # the client's own rows, for its own request
    assert r.json()["choices"][0]["text"] != want
    r = post(srv, chat_body(messages=conv, max_tokens=8, temperature=0))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want
    assert_serving(srv)


IMAGE_ROWS = 6  # make_image(84, 56): a 6x4 patch grid, merged 2x2


def _set_handle(**fields):
    def edit(mme: dict) -> None:
        mme["images"][0]["handle"].update(fields)
    return edit


def _rows(n: int, width: int, name: str = "rows") -> str:
    import torch

    return _rows_bytes(torch.randn(n, width), name)


def _shm(segment: str):
    """An shm handle (as a trusted client's) naming ``segment``."""
    def edit(mme: dict) -> None:
        h = mme["images"][0]["handle"]
        mme["images"][0]["handle"] = {
            "kind": "shm", "handle_id": "s1", "shape": h["shape"], "dtype": "float32",
            "release_address": None, "expires_at": h["expires_at"], "segment": segment}
    return edit


def _edit(path: str, value):
    def edit(mme: dict) -> None:
        *head, last = path.split(".")
        d = mme
        for k in head:
            d = d[int(k)] if k.isdigit() else d[k]
        d[last] = value(d[last]) if callable(value) else value
    return edit


BAD_EMBEDDINGS = [  # (what, edit of the encoded body, words of the 400)
    ("not safetensors", _set_handle(data=base64.b64encode(b"not safetensors").decode()),
     ["safetensors"]),
    ("no rows tensor", _set_handle(data=_rows(IMAGE_ROWS, 64, name="x")), ["rows"]),
    ("wrong width", _set_handle(shape=[IMAGE_ROWS, 65], data=_rows(IMAGE_ROWS, 65)),
     ["shape", "65"]),
    ("expired lease", _set_handle(expires_at=1.0), ["lease"]),
    ("float8 dtype", _set_handle(dtype="float8_e4m3fn"), ["dtype", "float8_e4m3fn"]),
    ("qint8 dtype", _set_handle(dtype="qint8"), ["dtype", "qint8"]),
    ("not a dtype", _set_handle(dtype="Tensor"), ["dtype"]),
    ("3-D shape", _set_handle(shape=[1, IMAGE_ROWS, 64]), ["shape"]),
    ("position_offset 2**70", _edit("position_offset", 2**70), ["position_offset"]),
    ("2-row prompt_positions", _edit("prompt_positions", lambda p: p[:2]),
     ["prompt_positions"]),
    ("a position past 64 bits", _edit("prompt_positions", lambda p: [[2**70] + r[1:] for r in p]),
     ["prompt_positions"]),
    ("positions shorter than the prompt", _edit("prompt_positions", lambda p: [r[:-1] for r in p]),
     ["prompt_positions"]),
    ("one row broadcast to the declared shape", _set_handle(data=_rows(1, 64)), ["shape"]),
    ("offset past the prompt", _edit("images.0.offset", 500), ["offset"]),
    ("negative offset", _edit("images.0.offset", -1), ["offset"]),
    ("length 0", lambda m: (_edit("images.0.length", 0)(m), _set_handle(
        shape=[0, 64], data=_rows(0, 64))(m)), ["length"]),
    ("a grid that is not the image's", _edit("images.0.encoder_meta", [1, 4, 4]),
     ["encoder_meta"]),
    ("a grid of no image", _edit("images.0.encoder_meta", [1, -2, 3]), ["encoder_meta"]),
    ("token ids not the prompt's", _edit("prompt_token_ids", lambda ids: ids[:-1]),
     ["prompt_token_ids"]),
    ("shm: a missing segment", _shm("vlmserve-test-no-such-segment"), ["segment"]),
    ("shm: a name with /", _shm("a/b"), ["segment"]),
    ("shm: ..", _shm(".."), ["segment"]),
    ("shm: NUL", _shm("a\x00b"), ["segment"]),
    ("shm: empty name", _shm(""), ["segment"]),
    ("shm: 300 characters", _shm("a" * 300), ["segment"]),
]


@pytest.mark.parametrize("what, edit, words", BAD_EMBEDDINGS, ids=[b[0] for b in BAD_EMBEDDINGS])
def test_malformed_multi_modal_embeddings_are_400s(srv, what, edit, words) -> None:
    from tests.engine.helpers import make_image

    mme = encoded([make_image(84, 56, 7)])
    assert len(mme["images"]) == 1 and mme["images"][0]["length"] == IMAGE_ROWS
    edit(mme)
    r = complete(srv, mme)
    assert_400(r, *words)
    assert_serving(srv)


def test_an_shm_segment_smaller_than_declared_is_a_400(srv) -> None:
    from multiprocessing.shared_memory import SharedMemory

    from tests.engine.helpers import make_image

    shm = SharedMemory(create=True, size=16)
    try:
        mme = encoded([make_image(84, 56, 7)])
        _shm(shm.name.lstrip("/"))(mme)
        assert_400(complete(srv, mme), "segment", "16")
    finally:
        shm.close()
        shm.unlink()
    assert_serving(srv)


def test_two_images_with_one_hash_and_different_lengths_are_a_400(srv) -> None:
    from tests.engine.helpers import make_image

    text = PROMPT.replace("<|image_pad|>", "<|image_pad|><|vision_end|><|vision_start|>"
                                           "<|image_pad|>", 1)
    mme = encoded([make_image(84, 56, 8), make_image(56, 56, 9)], text)
    mme["images"][1]["mm_hash"] = mme["images"][0]["mm_hash"]
    assert_400(complete(srv, mme, text), "mm_hash")
    assert_serving(srv)


def test_a_retried_body_and_an_image_listed_twice_are_served(srv) -> None:
    """A client's retry (the same body again) and one image's rows given for two
    placeholders are served: client handles are not held by this server's ledger of opens."""
    from tests.engine.helpers import make_image

    mme = encoded([make_image(84, 56, 10)])
    first = complete(srv, mme)
    assert first.status_code == 200, first.text
    again = complete(srv, mme)
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    text = PROMPT.replace("<|image_pad|>", "<|image_pad|><|vision_end|><|vision_start|>"
                                           "<|image_pad|>", 1)
    twice = encoded([make_image(84, 56, 10)] * 2, text)
    twice["images"][1]["handle"] = twice["images"][0]["handle"]
    r = complete(srv, twice, text)
    assert r.status_code == 200, r.text
    assert_serving(srv)


def _nested_schema(depth: int) -> dict:
    schema: dict = {}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


# other bad input that raised inside the server
@pytest.mark.parametrize("kw, words", [
    ({"stop_token_ids": [2**70]}, ["stop_token_ids"]),
    ({"stop_token_ids": [-1]}, ["stop_token_ids"]),
    ({"structured_outputs": {"json": "[" * 1200 + "]" * 1200}},
     ["JSON schema", "64 deep", "--max-grammar-nesting"]),
    ({"structured_outputs": {"json": '{"type": "array", "items": ' * 300 + "{}" + "}" * 300}},
     ["JSON schema", "64 deep", "--max-grammar-nesting"]),
    # as an object 500 deep: the preprocessing pool's pickling raised RecursionError (a 500)
    ({"structured_outputs": {"json": _nested_schema(500)}},
     ["JSON schema", "64 deep", "--max-grammar-nesting"]),
    ({"structured_outputs": {"regex": r"[^\s\S]"}}, ["regex", "matches nothing"]),
    ({"structured_outputs": {"regex": r"ab[^\d\D]c|x{0}[^\w\W]"}},
     ["regex", "matches nothing"]),
])
def test_bad_sampling_input_is_a_400(srv, kw, words) -> None:
    for stream in (False, True):
        assert_400(post(srv, chat_body(stream=stream, **kw)), *words)
    assert_serving(srv)


def test_a_tool_call_nested_past_the_parsers_depth_is_text() -> None:
    """`<tool_call>` and 1,200 `[` (what a regex can make a model write) is no call: the
    text is content, whole or streamed in pieces (it raised RecursionError: a 500, or a
    stream cut short)."""
    from vlmserve.entrypoints.openai.protocol import FunctionDefinition
    from vlmserve.entrypoints.openai.tool_calls import HermesCalls, auto_calls_of, tool_calls_of

    text = "<tool_call>" + "[" * 1200
    assert auto_calls_of(text) == (text, [])
    calls, content = HermesCalls(), ""
    for i in range(0, len(text), 100):
        content += calls.feed(text[i:i + 100])[0]
    got, events = calls.feed("", final=True)
    assert content + got == text and events == []
    closed = text + "</tool_call>"
    assert auto_calls_of(closed) == (closed, [])
    assert tool_calls_of("required", "[" * 1200) is None
    assert tool_calls_of(FunctionDefinition(name="f"), "[" * 1200) is None


def test_a_stream_that_fails_ends_with_an_error_event_and_done() -> None:
    """Whatever fails while a stream's events are made, the client gets an error event and
    `[DONE]`, and the request is aborted."""
    from vlmserve.entrypoints.openai.streaming import event_stream

    class Stream:
        aborted = False

        def abort(self) -> None:
            self.aborted = True

    async def events():
        yield 'data: {"choices": []}\n\n'
        raise RecursionError("maximum recursion depth exceeded")

    async def body(response) -> list[str]:
        return [chunk async for chunk in response.body_iterator]

    stream = Stream()
    got = asyncio.run(body(event_stream(events(), [stream])))
    assert got[0] == 'data: {"choices": []}\n\n' and got[-1] == "data: [DONE]\n\n"
    error = json.loads(got[-2].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and "RecursionError" in error["message"]
    assert stream.aborted
