"""Fuzzing a live `vlmserve serve` on the tiny model (issue 21).

schemathesis generates requests from the server's own `/openapi.json` (valid and invalid
ones); hypothesis strategies then send what a schema cannot say: raw JSON tokens (NaN,
1e400, 2**70), lone surrogates, deep nesting, image bytes; and (issue 39) the encoder
server's `/v1/encode`, a completion's client `multi_modal_embeddings` (the encoder server's
answer mutated), structured outputs and tools. Every answer must be a 2xx or a 4xx (a stream
must not end in a server error; in the issue 39 tests every 4xx also names its problem and
every stream ends with [DONE]), and after each batch the server is healthy and answers a
normal request. One LLM server and one encoder server for the module. Bounded and
reproducible: fixed seeds, no example database, a few thousand inputs in about three and a
half minutes on 2 cores. `pytest -q` prints how many inputs were
tried (the `pytest_terminal_summary` hook in tests/conftest.py).
"""

from __future__ import annotations

import base64
import functools
import io
import json
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.e2e.test_server import data_url, user
from tests.e2e.test_server_procs import MODEL, POOL, ServeProc
from tests.engine.helpers import make_image

CHAT, COMPLETIONS, ENCODE = "/v1/chat/completions", "/v1/completions", "/v1/encode"
MAX_REQUEST_BYTES = 1_000_000
NORMAL = {"model": MODEL, "messages": user("What is this?", data_url(make_image(56, 84, 0))),
          "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server(vlmserve_cache: Path) -> Iterator[ServeProc]:
    # small limits: every request is cheap, and the limits themselves get hit
    # and requests preprocessed in a pool process, as `vlmserve serve` does by default
    srv = ServeProc("--max-model-len", "512", "--default-max-tokens", "4",
                    "--max-request-bytes", str(MAX_REQUEST_BYTES), *POOL)
    yield srv
    srv.kill()


def health_problem(srv: ServeProc) -> str | None:
    """Why the server is not healthy, or None: `/health` 200, a normal request answered, and
    then (within 10 s) no request left in the engine and every KV block free."""
    if srv.proc.poll() is not None:
        return f"the server exited with {srv.proc.returncode}"
    try:
        h = httpx.get(srv.url + "/health", timeout=30)
        if h.status_code != 200:
            return f"/health answered {h.status_code}: {h.text[:300]}"
        r = httpx.post(srv.url + CHAT, json=NORMAL, timeout=60)
        if r.status_code != 200 or r.json()["choices"][0]["finish_reason"] != "length":
            return f"a normal request answered {r.status_code}: {r.text[:300]}"
        deadline = time.monotonic() + 10
        while True:
            s = srv.stats()
            if s["num_running"] == s["num_waiting"] == 0 and (
                    s["num_free_kv_blocks"] == s["num_kv_blocks"]):
                return None
            if time.monotonic() > deadline:
                return f"requests or KV blocks left behind: {s}"
            time.sleep(0.1)
    except httpx.HTTPError as e:
        return f"the server does not answer: {e!r}"


# ---- schemathesis ---------------------------------------------------------------------------


def test_fuzz_openapi_schemathesis(server: ServeProc, tmp_path: Path, record_property) -> None:
    """Every operation of `/openapi.json`: its examples, the coverage phase (boundaries,
    wrong types, missing fields, undeclared methods) and hypothesis-driven fuzzing, valid and
    invalid inputs both."""
    report = tmp_path / "events.ndjson"
    checks = ("not_a_server_error,status_code_conformance,content_type_conformance,"
              "response_schema_conformance,unsupported_method")
    run = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", server.url + "/openapi.json",
         "--checks", checks, "--mode", "all", "--phases", "examples,coverage,fuzzing",
         "--max-examples", "50", "--seed", "21", "--generation-database", "none",
         "--workers", "1", "--continue-on-failure", "--request-timeout", "60",
         "--no-color", "--output-sanitize", "false", "--output-truncate", "true",
         "--report", "ndjson", "--report-ndjson-path", str(report)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    tried, statuses = 0, {}
    for line in report.read_text().splitlines() if report.exists() else ():
        event = json.loads(line).get("ScenarioFinished")
        for it in (event or {}).get("recorder", {}).get("interactions", {}).values():
            tried += 1
            status = (it.get("response") or {}).get("status_code", "no answer")
            statuses[status] = statuses.get(status, 0) + 1
    record_property("fuzz_inputs", tried)
    print(f"fuzz: schemathesis tried {tried} inputs, answers {sorted(statuses.items(), key=str)}")
    problem = health_problem(server)
    assert run.returncode == 0 and problem is None, (
        f"{problem or 'the server stayed healthy'}; schemathesis exited {run.returncode} after "
        f"{tried} inputs:\n{run.stdout[-20000:]}\n{run.stderr[-3000:]}")
    assert tried > 500


# ---- hypothesis: raw bodies -------------------------------------------------------------------


class Raw(str):
    """A JSON token written as is: NaN, Infinity, 1e400, -0, or not JSON at all."""


def dumps(value: Any, ascii_only: bool = True) -> str:
    """JSON with `Raw` tokens; NaN and infinite floats as the tokens NaN and Infinity."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{dumps(str(k), ascii_only)}:{dumps(v, ascii_only)}"
                              for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dumps(v, ascii_only) for v in value) + "]"
    return json.dumps(value, ensure_ascii=ascii_only)


@st.composite
def encoded(draw: st.DrawFn, body: Any) -> bytes:
    """`body` as bytes: all ASCII with \\u escapes (lone surrogates as `\\ud800`), or UTF-8
    (lone surrogates as the invalid bytes `surrogatepass` writes)."""
    if draw(st.booleans()):
        return dumps(body).encode()
    return dumps(body, ascii_only=False).encode("utf-8", "surrogatepass")


class Poster:
    """Posts raw bodies; keeps the shortest input per kind of 5xx (or of no answer). With
    ``strict``, also: every 4xx in OpenAI's error format with a message saying what is
    wrong, and every stream ends with ``data: [DONE]`` (after its error event, if any)."""

    def __init__(self, srv: ServeProc, strict: bool = False) -> None:
        self.srv, self.tried, self.dead_after, self.strict = srv, 0, None, strict
        self.client = httpx.Client(base_url=srv.url, timeout=60,
                                   limits=httpx.Limits(max_connections=16))
        self.failures: dict[str, tuple[str, bytes]] = {}
        self.statuses: dict[int, int] = {}  # answers by status (streams: their first line)
        self.lock = threading.Lock()  # posts may come from several threads

    def post(self, path: str, body: bytes, hang_up_after: int | None = None) -> None:
        """POST `body`; with `hang_up_after`, close the connection after that many lines of
        the answer (a client that goes away mid-stream)."""
        if self.dead_after is not None:  # one input killed it: the rest would only repeat that
            return
        with self.lock:
            self.tried += 1
        try:
            if hang_up_after is not None:
                with self.client.stream("POST", path, content=body,
                                        headers={"content-type": "application/json"}) as r:
                    lines = r.iter_lines()
                    for _ in zip(range(hang_up_after), lines, strict=False):
                        pass
                    if r.status_code >= 500:
                        self.fail(f"{r.status_code} (hung up)", path, body)
                return
            r = self.client.post(path, content=body, headers={"content-type": "application/json"})
        except httpx.TimeoutException:
            return self.fail("no answer within 60 s", path, body)
        except httpx.TransportError as e:
            return self.transport_error(e, path, body)
        with self.lock:
            self.statuses[r.status_code] = self.statuses.get(r.status_code, 0) + 1
        self.check(r, path, body)

    def transport_error(self, e: httpx.TransportError, path: str, body: bytes) -> None:
        try:
            alive = httpx.get(self.srv.url + "/health", timeout=30).status_code == 200
        except httpx.HTTPError:
            alive = False
        if self.srv.proc.poll() is not None or not alive:
            self.dead_after = (path, body)
        self.fail(f"connection failed: {type(e).__name__}", path, body)

    def check(self, r: httpx.Response, path: str, body: bytes) -> None:
        """The answer `r` to `body`: no 5xx, no stream ending in a server error, a 200 with
        its answer (strict: each 4xx naming its problem, each stream ending with [DONE])."""
        if r.status_code >= 500:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text
            return self.fail(f"{r.status_code}: {message[:160]}", path, body)
        if r.status_code >= 400 and self.strict:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = None
            if not isinstance(message, str) or len(message) < 12:
                return self.fail(f"{r.status_code} naming nothing: {r.text[:160]}", path, body)
        if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-"):
            lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
            for line in lines:
                if line.startswith("data: {") and '"server_error"' in line:
                    return self.fail(f"stream ended in {line[6:166]}", path, body)
            if self.strict and (not lines or lines[-1] != "data: [DONE]"):
                return self.fail(f"stream without [DONE]: {lines[-1:]}", path, body)
        elif r.status_code == 200 and path == ENCODE:
            try:
                r.json()["images"]
            except (ValueError, KeyError, TypeError):
                return self.fail(f"200 but no images: {r.text[:160]}", path, body)
        elif r.status_code == 200:
            try:
                r.json()["choices"][0]
            except (ValueError, KeyError, TypeError, IndexError):
                return self.fail(f"200 but no completion: {r.text[:160]}", path, body)

    def fail(self, kind: str, path: str, body: bytes) -> None:
        with self.lock:
            if kind not in self.failures or len(body) < len(self.failures[kind][1]):
                self.failures[kind] = (path, body)

    def report(self) -> str:
        lines = []
        if self.dead_after is not None:
            lines.append(f"THE SERVER DIED after {self.dead_after[1][:2000]!r}")
        for kind, (path, body) in self.failures.items():
            shown = body[:1500].decode("utf-8", "backslashreplace")
            if len(body) > 1500:
                shown += f"... ({len(body)} bytes in all)"
            lines.append(f"{kind}\n  curl -H 'content-type: application/json' "
                         f"--data-binary @- {self.srv.url}{path} <<'EOF'\n{shown}\nEOF")
        return "\n".join(lines)


def fuzz(srv: ServeProc, record_property: Callable, cases: st.SearchStrategy,
         max_examples: int, strict: bool = False,
         healthy: Callable[[], str | None] | None = None) -> None:
    """One batch: `max_examples` (path, body) inputs from `cases`, then the server must be
    healthy (``healthy``: what else must be, or why not) and no input may have had a 5xx
    (``strict``: see `Poster`)."""
    poster = Poster(srv, strict)

    @settings(max_examples=max_examples, derandomize=True, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(cases)
    def one(case: tuple[str, bytes] | list[tuple[str, bytes, int | None]]) -> None:
        if isinstance(case, tuple):
            return poster.post(*case)
        with ThreadPoolExecutor(len(case)) as pool:  # a list: all at once
            list(pool.map(lambda c: poster.post(*c), case))

    one()
    record_property("fuzz_inputs", poster.tried)
    print(f"fuzz: {poster.tried} inputs, answers {sorted(poster.statuses.items())}")
    problem = health_problem(srv) if healthy is None else healthy()
    assert not poster.failures and problem is None, (
        f"{problem or 'the server stayed healthy'}; {len(poster.failures)} kinds of failure in "
        f"{poster.tried} inputs:\n{poster.report()}")


def chat_case(fields: st.SearchStrategy[dict], paths: tuple[str, ...] = (CHAT, COMPLETIONS)
              ) -> st.SearchStrategy[tuple[str, bytes]]:
    """A request to one of `paths` with a normal prompt and `fields` over it."""

    @st.composite
    def case(draw: st.DrawFn) -> tuple[str, bytes]:
        path = draw(st.sampled_from(paths))
        body: dict = {"messages": user("Hi.")} if path == CHAT else {"prompt": "Hi."}
        body.update(draw(fields))
        return path, draw(encoded(body))

    return case()


# ---- numbers ----------------------------------------------------------------------------------

RAW_NUMBERS = [Raw(t) for t in (
    "NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1e-400", "-0", "-0.0", "0e0", "1E2",
    "1.0", "2.0e0", "5e-324", "2.5e-324", "1e-40", "-1e-40", "1e-310", "1.7976931348623157e308",
    "9007199254740993", "18446744073709551616", "-9223372036854775809", "1" + "0" * 400,
    "01", "+1", ".5", "1.", "0x10", "1_0")]
EDGE_VALUES = [
    0, 1, -1, 2, 0.0, -0.0, 1.0, 0.5, 1e-40, 5e-324, 2.2250738585072014e-308, 1e308,
    float("nan"), float("inf"), -float("inf"), 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1,
    2**63, 2**64 - 1, 2**64, 2**70, -2**63, -2**63 - 1, -2**64, -2**70, 10**100, True, False,
    None, "1", "0.5", "", "NaN", [], [1], {}, {"value": 1}]
NUMBER = st.one_of(st.sampled_from(RAW_NUMBERS + EDGE_VALUES), st.integers(), st.floats(),
                   st.integers(-2**70, 2**70), st.floats(-1e-300, 1e-300))
NUMERIC_FIELDS = ("temperature", "top_p", "top_k", "seed", "max_tokens", "max_completion_tokens",
                  "n", "presence_penalty", "frequency_penalty", "top_logprobs", "best_of",
                  "repetition_penalty", "min_p", "min_tokens")


def test_fuzz_sampling_numbers(server: ServeProc, record_property) -> None:
    # a few fields at a time, so that many requests pass validation and reach the engine
    fields = st.tuples(
        st.dictionaries(st.sampled_from(NUMERIC_FIELDS), NUMBER, min_size=1, max_size=3),
        st.fixed_dictionaries({}, optional={
            "stop_token_ids": st.lists(NUMBER, max_size=3), "stream": st.booleans(),
            "ignore_eos": st.sampled_from([True, False, 0, 1, "true", None])}),
    ).map(lambda t: {**t[0], **t[1]})
    fuzz(server, record_property, chat_case(fields), 400)


def test_fuzz_token_ids(server: ServeProc, record_property) -> None:
    ids = st.one_of(st.integers(0, 447), st.sampled_from([441, 443, 444, 445, 446, 447, 448]),
                    NUMBER)
    prompt = st.one_of(st.lists(ids, max_size=8), st.lists(st.integers(0, 447), max_size=600),
                       st.lists(st.lists(ids, max_size=4), max_size=2),
                       st.lists(st.one_of(ids, st.text(max_size=4)), max_size=3))
    fields = st.fixed_dictionaries({"prompt": prompt}, optional={
        # short outputs, and the lengths around the context's end (512), which are refused
        # unless the prompt is nearly empty: every input stays cheap to answer
        "stop_token_ids": st.lists(ids, max_size=3),
        "max_tokens": st.one_of(st.integers(-1, 12), st.sampled_from([508, 511, 512, 513, 600])),
        "stream": st.booleans(), "temperature": st.sampled_from([0, 1.0])})
    fuzz(server, record_property, chat_case(fields, (COMPLETIONS,)), 200)


# ---- text -------------------------------------------------------------------------------------

SPECIAL_TEXT = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_start|>",
                "<|image_pad|>", "<|vision_end|>", "<|video_pad|>", "\x00", "\ud800", "\udfff",
                "\udc00\ud800", "\ud83d\ude00", "\U0001f600", "\ufeff", "\u202e", "\u0301",
                "\uffff", "\r\n", "{{ messages }}", "{% endfor %}", "user\n", "A" * 3000]
# st.characters() with no arguments: every code point, lone surrogates included
TEXT = st.one_of(
    st.text(st.characters(), max_size=40),
    st.lists(st.one_of(st.sampled_from(SPECIAL_TEXT), st.text(st.characters(), max_size=6)),
             max_size=8).map("".join),
    st.sampled_from([100, 5000, 16384, 16385, 200_000]).map(lambda n: ("xy z" * n)[:n]))
ROLE = st.one_of(st.sampled_from(["system", "developer", "user", "assistant", "tool", "function",
                                  "", "USER"]), st.text(st.characters(), max_size=5))
MESSAGE = st.fixed_dictionaries(
    {"role": ROLE, "content": st.one_of(
        TEXT, st.none(),
        st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=3))},
    optional={"name": TEXT, "tool_call_id": TEXT})


def test_fuzz_unicode_text(server: ServeProc, record_property) -> None:
    @st.composite
    def case(draw: st.DrawFn) -> tuple[str, bytes]:
        if draw(st.booleans()):
            body = {"messages": draw(st.lists(MESSAGE, min_size=1, max_size=4))}
            path = CHAT
        else:
            body, path = {"prompt": draw(TEXT)}, COMPLETIONS
        body.update(draw(st.fixed_dictionaries({}, optional={
            "stop": st.one_of(TEXT, st.lists(TEXT, max_size=5)),
            "model": st.one_of(st.just(MODEL), TEXT), "user": TEXT, "stream": st.booleans(),
            "temperature": st.just(0)})))
        return path, draw(encoded(body))

    fuzz(server, record_property, case(), 400)


# ---- JSON structure ---------------------------------------------------------------------------

JSON_VALUE = st.recursive(
    st.none() | st.booleans() | NUMBER | st.text(st.characters(), max_size=10),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(st.characters(), max_size=6), inner, max_size=3),
    max_leaves=10)
FIELDS = ("model", "messages", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed",
          "stop", "n", "stream", "stream_options", "ignore_eos", "stop_token_ids", "user",
          "metadata", "tools", "tool_choice", "response_format", "logit_bias", "logprobs",
          "skip_special_tokens", "include_stop_str_in_output", "max_completion_tokens")


def nested(depth: int, kind: str) -> str:
    return {"[": "[" * depth + "]" * depth, "{": '{"a":' * depth + "null" + "}" * depth,
            "mixed": '[{"a":' * (depth // 2) + "1" + "}]" * (depth // 2)}[kind]


@st.composite
def structure_case(draw: st.DrawFn) -> tuple[str, bytes]:
    path = draw(st.sampled_from([CHAT, COMPLETIONS]))
    base = {"messages": user("Hi.")} if path == CHAT else {"prompt": "Hi."}
    kind = draw(st.sampled_from(["deep", "fields", "top", "bytes", "cut", "dupe", "big"]))
    if kind == "deep":  # nesting as the body, or as the value of one field
        text = nested(draw(st.sampled_from([32, 200, 1000, 10_000, 50_000, 200_000])),
                      draw(st.sampled_from(["[", "{", "mixed"])))
        field = draw(st.sampled_from([None, "messages", "prompt", "temperature", "stop",
                                      "metadata", "content", "image_url"]))
        if field is None:
            return path, text.encode()
        if field in ("content", "image_url"):
            inner = ('{"type":"image_url","image_url":' + text + "}") if field == "image_url" \
                else text
            return CHAT, ('{"messages":[{"role":"user","content":' + inner + "}]}").encode()
        return path, (dumps(base)[:-1] + f',"{field}":{text}}}').encode()
    if kind == "fields":  # any JSON value in any field, known or not
        body = {**base, **draw(st.dictionaries(
            st.sampled_from(FIELDS) | st.text(st.characters(), max_size=6), JSON_VALUE,
            min_size=1, max_size=4))}
        return path, draw(encoded(body))
    if kind == "top":  # a body that is not an object
        return path, draw(encoded(draw(JSON_VALUE)))
    if kind == "bytes":
        return path, draw(st.binary(max_size=300))
    body = dumps({**base, "max_tokens": 4}).encode()
    if kind == "cut":  # a valid body cut short, or with something before or after it
        cut = draw(st.integers(0, len(body) - 1))
        return path, draw(st.sampled_from([body[:cut], b"\xef\xbb\xbf" + body, body + b"}",
                                           body + b"\x00", b" \n\t" + body + b"\n"]))
    if kind == "dupe":  # a key twice
        key = draw(st.sampled_from(["max_tokens", "messages", "prompt", "temperature"]))
        value = draw(JSON_VALUE)
        return path, body[:-1] + f',"{key}":{dumps(value)}}}'.encode()
    size = draw(st.sampled_from([MAX_REQUEST_BYTES - 200, MAX_REQUEST_BYTES + 1]))
    return path, dumps({**base, "user": "u" * size}).encode()  # near and over the limit


def test_fuzz_json_structure(server: ServeProc, record_property) -> None:
    fuzz(server, record_property, structure_case(), 400)


# ---- images -----------------------------------------------------------------------------------

SIZES = [(1, 1), (1, 2000), (2000, 1), (2, 3), (27, 29), (28, 28), (56, 84), (300, 7)]
MODES = ["RGB", "RGBA", "L", "LA", "1", "P", "I", "F", "CMYK", "I;16"]
FORMATS = ["PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF", "ICO", "PPM"]


@functools.cache
def image_bytes(size: tuple[int, int], mode: str, fmt: str) -> bytes:
    """An image file, or b"" where PIL cannot write this mode in this format."""
    img = make_image(*size, seed=size[0] * 7 + size[1])
    try:
        img = img.convert(mode)
        buf = io.BytesIO()
        img.save(buf, format=fmt)
        return buf.getvalue()
    except (OSError, ValueError, KeyError, TypeError):
        return b""


def png_claiming(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header claims `width` x `height` (CRC fixed)."""
    png = bytearray(image_bytes((1, 1), "RGB", "PNG"))
    png[16:24] = width.to_bytes(4, "big") + height.to_bytes(4, "big")
    png[29:33] = zlib.crc32(bytes(png[12:29])).to_bytes(4, "big")
    return bytes(png)


def b64_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


BAD_URLS = [
    "", " ", "data:", "data:,", "data:image/png;base64,", "data:image/png;base64,!!!!",
    "data:image/png;base64,iVBORw0KGgo", "data:image/png;base64,====", "data:image/png;base64",
    "data:text/plain;base64,aGVsbG8=", "data:image/svg+xml;utf8,<svg xmlns='x'/>",
    "data:image/png,%89PNG%0D%0A", "DATA:IMAGE/PNG;BASE64,iVBORw0KGgo=", "data:;base64,AAAA",
    "file:///etc/passwd", "file:///dev/zero", "file:///proc/self/mem", "/etc/passwd",
    "../../../etc/passwd", "C:\\Windows\\win.ini", "ftp://127.0.0.1/x.png",
    "http://127.0.0.1:1/x.png", "https://example.invalid/x.png", "gopher://127.0.0.1:1/",
    "javascript:alert(1)", "http://[::1", "\x00", "\ud800", "x" * 5000]


@st.composite
def image_url(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["valid", "cut", "flipped", "random", "claims", "bad", "b64"]))
    size, mode = draw(st.sampled_from(SIZES)), draw(st.sampled_from(MODES))
    fmt = draw(st.sampled_from(FORMATS))
    data = image_bytes(size, mode, fmt) or image_bytes(size, "RGB", "PNG")
    if kind == "valid":
        return b64_url(data, f"image/{fmt.lower()}")
    if kind == "cut":
        return b64_url(data[:draw(st.integers(0, len(data) - 1))])
    if kind == "flipped":
        out = bytearray(data)
        for i, v in draw(st.lists(st.tuples(st.integers(0, len(out) - 1), st.integers(0, 255)),
                                  min_size=1, max_size=8)):
            out[i] = v
        return b64_url(bytes(out))
    if kind == "random":
        head = draw(st.sampled_from([b"", b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF89a",
                                     b"RIFF\x00\x00\x00\x00WEBPVP8 ", b"BM", b"II*\x00"]))
        return b64_url(head + draw(st.binary(max_size=200)))
    if kind == "claims":
        return b64_url(png_claiming(*draw(st.sampled_from(
            [(0, 0), (0, 1), (1, 0), (65535, 65535), (100_000, 100_000), (2**31 - 1, 1),
             (2**31 - 1, 2**31 - 1), (2**32 - 1, 2**32 - 1), (1, 2**20)]))))
    if kind == "bad":
        return draw(st.sampled_from(BAD_URLS))
    text = base64.b64encode(data).decode()  # base64 as people get it wrong
    return "data:image/png;base64," + draw(st.sampled_from([
        text.rstrip("="), text + "=", text.replace("+", "-").replace("/", "_"),
        "\n".join(text[i:i + 76] for i in range(0, len(text), 76)), " " + text, text + "%3D"]))


IMAGE_PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries(
        {"url": image_url()}, optional={"detail": st.sampled_from(
            ["auto", "low", "high", "ultra", None, 5])})}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "image", "input_image"]),
                           "image_url": st.one_of(image_url(), JSON_VALUE)}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries(
        {"url": JSON_VALUE})}))


def test_fuzz_images(server: ServeProc, record_property) -> None:
    @st.composite
    def case(draw: st.DrawFn) -> tuple[str, bytes]:
        images = draw(st.lists(IMAGE_PART, min_size=1, max_size=10))
        parts = draw(st.permutations([*images, {"type": "text", "text": "What is this?"}]))
        body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 2,
                "stream": draw(st.booleans())}
        return CHAT, draw(encoded(body))

    fuzz(server, record_property, case(), 300)


# ---- several at once, clients that hang up ---------------------------------------------------


def test_fuzz_concurrent_and_hang_ups(server: ServeProc, record_property) -> None:
    """Bad requests next to good ones in the same engine steps, streams and requests whose
    client goes away after 0-3 lines: the engine ends with nothing left behind."""
    good = st.fixed_dictionaries({"max_tokens": st.integers(1, 24), "stream": st.booleans(),
                                  "ignore_eos": st.just(True), "temperature": st.just(0)})
    numbers = st.dictionaries(st.sampled_from(NUMERIC_FIELDS), NUMBER, max_size=2)
    images = st.lists(IMAGE_PART, min_size=1, max_size=3).map(lambda parts: dumps(
        {"messages": [{"role": "user", "content": parts}], "max_tokens": 8, "stream": True}))
    one = st.one_of(chat_case(good), chat_case(numbers), structure_case(),
                    st.tuples(st.just(CHAT), images.map(str.encode)))
    batch = st.lists(st.tuples(one, st.sampled_from([None, None, 0, 1, 3])).map(
        lambda t: (*t[0], t[1])), min_size=2, max_size=8)
    fuzz(server, record_property, batch, 100)


# ---- the encoder server, client embeddings, structured outputs and tools (issue 39) ----------
# strict: every 4xx names the problem and every stream ends with [DONE]


@pytest.fixture(scope="module")
def encoder(vlmserve_cache: Path) -> Iterator[ServeProc]:
    """An encoder server (`--role encoder`) of the same model; its leases outlast the module,
    so the handles of `encoded_prompt` stay valid."""
    enc = ServeProc("--role", "encoder", "--encoder-lease", "600",
                    "--max-request-bytes", str(MAX_REQUEST_BYTES))
    yield enc
    enc.kill()


PIXELS = make_image(56, 56, 5)  # the tiny model's grid [1, 4, 4]: 4 rows
PIXEL_IMAGE = {"mm_hash": "f" * 64, "encoder_meta": [1, 4, 4], "length": 4,
               "shape": [56, 56, 3], "pixels": base64.b64encode(PIXELS.tobytes()).decode()}
EMBED_PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe."
                "<|im_end|>\n<|im_start|>assistant\n")


def encoder_problem(enc: ServeProc, llm: ServeProc) -> str | None:
    """Why the encoder server or the LLM server is not healthy: both `/health` 200, a
    normal encode (an image URL and preprocessed pixels) answered, then `health_problem`."""
    try:
        h = httpx.get(enc.url + "/health", timeout=30)
        if h.status_code != 200:
            return f"the encoder's /health answered {h.status_code}: {h.text[:300]}"
        r = httpx.post(enc.url + ENCODE, timeout=60, json={
            "images": [data_url(make_image(56, 84, 0)), PIXEL_IMAGE], "transport": "bytes"})
        if r.status_code != 200 or len(r.json()["images"]) != 2:
            return f"a normal encode answered {r.status_code}: {r.text[:300]}"
    except httpx.HTTPError as e:
        return f"the encoder server does not answer: {e!r}"
    return health_problem(llm)


def mutated(draw: st.DrawFn, value: Any, edits: st.SearchStrategy) -> Any:
    """`value` (JSON data) with 1-3 of its leaves or fields replaced, dropped or added."""
    value = json.loads(json.dumps(value))
    for _ in range(draw(st.integers(1, 3))):
        node, key = None, None
        cur = value
        while isinstance(cur, (dict, list)) and cur and draw(st.integers(0, 3)):
            node = cur
            key = (draw(st.sampled_from(sorted(cur))) if isinstance(cur, dict)
                   else draw(st.integers(0, len(cur) - 1)))
            cur = cur[key]
        if node is None:
            continue
        action = draw(st.sampled_from(["set", "set", "set", "drop", "add"]))
        if action == "drop":
            del node[key]
        elif action == "add" and isinstance(node, dict):
            node[draw(st.text(st.characters(), max_size=6))] = draw(edits)
        elif action == "add":
            node.append(draw(st.sampled_from(node)))
        else:
            node[key] = draw(edits)
    return value


ODD_INTS = st.sampled_from([0, -1, 1, 2, 3, 4, 5, 56, 2**31, 2**63, 2**70, -2**70])
EDITS = st.one_of(NUMBER, ODD_INTS, JSON_VALUE, st.text(st.characters(), max_size=8),
                  st.lists(ODD_INTS, max_size=4))
TRANSPORTS = st.sampled_from(["bytes", "shm", "cuda", "auto", "", "BYTES", "x", None, 1])


def test_fuzz_encoder_server(encoder: ServeProc, server: ServeProc, record_property) -> None:
    """POST /v1/encode: image URLs, preprocessed pixels mutated (shapes, grids, lengths,
    bytes, hashes), transports, consumers, prompts, unknown fields, raw bodies: each a 200 or
    a 4xx naming the problem; the encoder keeps encoding."""
    @st.composite
    def case(draw: st.DrawFn) -> tuple[str, bytes]:
        kind = draw(st.sampled_from(["pixels", "pixels", "urls", "fields", "raw"]))
        body: dict = {"transport": draw(TRANSPORTS)}
        if kind == "pixels":
            body["images"] = [mutated(draw, PIXEL_IMAGE, EDITS) if draw(st.booleans())
                              else PIXEL_IMAGE for _ in range(draw(st.integers(1, 3)))]
        elif kind == "urls":
            body["images"] = draw(st.lists(image_url(), min_size=0, max_size=3))
            if draw(st.booleans()):
                body["prompt"] = draw(st.one_of(TEXT, st.just(EMBED_PROMPT)))
        else:
            body = mutated(draw, {"images": [PIXEL_IMAGE], "transport": "bytes",
                                  "prompt": None, "consumer": "llm-1", "consumer_rows": 8},
                           EDITS)
        if kind == "raw":
            return ENCODE, draw(st.sampled_from([b"", b"{", b"[]", b"null", dumps(body)[:9]
                                                 .encode(), b"\xff\xfe"]))
        return ENCODE, draw(encoded(body))

    fuzz(encoder, record_property, case(), 120, strict=True,
         healthy=lambda: encoder_problem(encoder, server))


@pytest.fixture(scope="module")
def encoded_prompt(encoder: ServeProc) -> dict:
    """`EMBED_PROMPT`'s image encoded at the encoder server, a bytes handle: a completion's
    valid `multi_modal_embeddings`."""
    r = httpx.post(encoder.url + ENCODE, timeout=60, json={
        "prompt": EMBED_PROMPT, "images": [data_url(make_image(56, 56, 7))],
        "transport": "bytes"})
    assert r.status_code == 200, r.text
    return r.json()


def test_fuzz_multi_modal_embeddings(encoder: ServeProc, server: ServeProc, encoded_prompt,
                                     record_property) -> None:
    """A completion's `multi_modal_embeddings` from a client: the encoder server's answer
    with its fields mutated (token ids, positions, offsets, lengths, grids, hashes; the
    handle's kind, shape, dtype, bytes, lease), images repeated or dropped, the same body
    sent twice, streamed or not: each a 200 or a 4xx naming the problem."""
    handle = encoded_prompt["images"][0]["handle"]
    rows = base64.b64decode(handle["data"])
    handle_edits = st.one_of(
        st.fixed_dictionaries({"kind": st.sampled_from(["shm", "cuda", "x", "bytes"])}),
        st.fixed_dictionaries({"dtype": st.sampled_from(
            ["float8_e4m3fn", "qint8", "int64", "float64", "bfloat16", "float16", "x", ""])}),
        st.fixed_dictionaries({"shape": st.sampled_from(
            [[1, 64], [2, 64, 1], [-1, 64], [2**40, 64], [0, 64], [4], [], [2**70, 1]])}),
        st.fixed_dictionaries({"data": st.one_of(
            st.binary(max_size=64), st.integers(0, len(rows)).map(lambda n: rows[:n]),
            st.just(rows + rows)).map(lambda b: base64.b64encode(b).decode())}),
        st.fixed_dictionaries({"segment": st.sampled_from(
            ["/x", "..", "a\x00b", "", "s" * 300, "vlmserve-none"]), "kind": st.just("shm")}),
        st.fixed_dictionaries({"expires_at": st.sampled_from([0, -1, 1e308, 2**70])}))

    @st.composite
    def case(draw: st.DrawFn) -> tuple[str, bytes] | list[tuple[str, bytes, None]]:
        mm = json.loads(json.dumps(encoded_prompt))
        kind = draw(st.sampled_from(["fields", "fields", "handle", "images", "twice"]))
        if kind == "fields":
            mm = mutated(draw, mm, EDITS)
        elif kind == "handle":
            mm["images"][0]["handle"].update(draw(handle_edits))
        elif kind == "images":
            mm["images"] = draw(st.sampled_from([[], mm["images"] * 2, mm["images"] * 40]))
        body = {"model": MODEL, "prompt": EMBED_PROMPT, "max_tokens": 3,
                "multi_modal_embeddings": mm, **draw(st.fixed_dictionaries({}, optional={
                    "stream": st.booleans(), "n": st.sampled_from([1, 2]),
                    "temperature": st.just(0), "prompt": st.sampled_from(
                        [EMBED_PROMPT + " ", [1, 2], ["a", "b"], "Hi."])}))}
        data = draw(encoded(body))
        if kind == "twice":  # a client's retry: the same handles again, at once
            return [(COMPLETIONS, data, None), (COMPLETIONS, data, None)]
        return COMPLETIONS, data

    fuzz(server, record_property, case(), 120, strict=True,
         healthy=lambda: embeddings_problem(server, encoded_prompt))


def embeddings_problem(srv: ServeProc, mm: dict) -> str | None:
    """`health_problem`, and the valid `multi_modal_embeddings` still served."""
    problem = health_problem(srv)
    if problem is not None:
        return problem
    r = httpx.post(srv.url + COMPLETIONS, timeout=60, json={
        "model": MODEL, "prompt": EMBED_PROMPT, "max_tokens": 3, "multi_modal_embeddings": mm})
    return None if r.status_code == 200 else f"valid embeddings answered {r.status_code}: " \
        f"{r.text[:300]}"


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
          "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "get", "parameters": SCHEMA}}


@st.composite
def structured_fields(draw: st.DrawFn) -> dict:
    """Structured outputs (response_format, vLLM's structured_outputs and guided_*) and
    tools, valid, odd and malformed."""
    schema = draw(st.one_of(st.just(SCHEMA), JSON_VALUE, odd_schema()))
    kind = draw(st.sampled_from(["response_format", "structured", "guided", "tools"]))
    if kind == "response_format":
        return {"response_format": draw(st.one_of(
            st.just({"type": "json_object"}), st.just({"type": "text"}),
            st.builds(lambda s, n: {"type": "json_schema", "json_schema": {
                "name": n, "schema": s}}, st.just(schema), st.text(max_size=5)),
            JSON_VALUE))}
    if kind == "structured":
        return {"structured_outputs": draw(st.one_of(
            st.fixed_dictionaries({"json": st.just(schema)}),
            st.fixed_dictionaries({"regex": st.sampled_from(
                ["[a-z]{1,3}", "[^\\s\\S]", "(", "a{1000000}", "\\d+", "", "(a|b)*c"])}),
            st.fixed_dictionaries({"choice": st.one_of(
                st.lists(st.text(max_size=4), max_size=5), st.just([]), JSON_VALUE)}),
            st.fixed_dictionaries({"grammar": st.sampled_from(
                ['root ::= "yes" | "no"', "root ::=", "root ::= root", "x", ""])}),
            st.just({"json_object": True}), JSON_VALUE))}
    if kind == "guided":
        return draw(st.fixed_dictionaries({}, optional={
            "guided_json": st.just(schema), "guided_regex": st.sampled_from(["a+", "("]),
            "guided_choice": st.lists(st.text(max_size=3), max_size=3)}))
    tools = draw(st.one_of(
        st.lists(st.just(TOOL), min_size=1, max_size=3),
        st.lists(st.builds(lambda n, p: {"type": "function", "function": {
            "name": n, "parameters": p}}, st.text(st.characters(), max_size=6),
            st.one_of(st.just(schema), JSON_VALUE)), min_size=1, max_size=3),
        st.just([TOOL] * 200), JSON_VALUE))
    choice = draw(st.one_of(st.sampled_from(["required", "auto", "none", "any", None]),
                            st.just({"type": "function", "function": {"name": "get"}}),
                            st.just({"type": "function", "function": {"name": "missing"}}),
                            JSON_VALUE))
    return {"tools": tools, "tool_choice": choice}


@st.composite
def odd_schema(draw: st.DrawFn) -> Any:
    return mutated(draw, SCHEMA, EDITS)


def test_fuzz_structured_outputs_and_tools(server: ServeProc, record_property) -> None:
    """Structured outputs and tool calls with valid, odd and malformed schemas, regular
    expressions (one that cannot match), choices, grammars, tool lists (over --max-tools)
    and tool choices, streamed or not: each a 200 or a 4xx naming the problem."""
    fields = st.tuples(structured_fields(), st.fixed_dictionaries(
        {"max_tokens": st.integers(1, 6)},
        optional={"stream": st.booleans(), "temperature": st.sampled_from([0, 1.0])})).map(
        lambda t: {**t[0], **t[1]})
    fuzz(server, record_property, chat_case(fields), 120, strict=True)
