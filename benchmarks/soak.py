"""Bounded soak benchmark: mixed streaming traffic, client aborts and bad inputs (issue 21).

    python benchmarks/soak.py --model tiny-qwen2-vl --duration 600 \\
        --server-args "--dtype float32 --device cpu --max-model-len 1024" --out soak.json
    python benchmarks/soak.py --duration 600 --concurrency 8 --bad-fraction 0.3 --server-args \
        "--dtype float32 --device cpu --max-model-len 1024 --accept-encoder-handles bytes,shm"
        # issue 39's soak: shm handles accepted too, so their segment checks are reached
    python benchmarks/soak.py --url http://127.0.0.1:8000 --server-pid PID   # attach

Starts `python -m vlmserve serve MODEL` in its own process group (or attaches to `--url`), then
`--concurrency` clients send, for `--duration` seconds, a mix of streaming and non-streaming
chat requests with 0-3 images (PNG/JPEG data URLs of varied sizes, half drawn from a small
pool so the encoder cache hits), text completions, streams the client closes after k chunks,
non-streaming requests it abandons, and bad inputs (invalid JSON, unsupported fields, bad image
bytes, over-long prompts, out-of-range sampling values, a wrong model name) and, with
`--hostile` (the default), issue 39's: structured outputs (JSON schemas oversized or nested
500 deep, as dicts and as strings; an unsatisfiable regex; 5,000 choices), 2,000 tools,
`stop_token_ids` [2**70], a huge `n`, `logit_bias` out of range, client
`multi_modal_embeddings` valid (sent again: a retry) and malformed (not safetensors, wrong
shape or dtype, bogus shm segment names...), placeholder tokens without images in raw prompts
and token ids, a 1x1 image, a tiny video and videos whose header declares a huge frame,
`chat_template_kwargs` abuse; each kind with the statuses it may get. Every stream must end
with `data: [DONE]` (after its error event, whose status counts as the request's). The
server's process tree RSS/PSS (from /proc) and its `/stats` (KV blocks, encoder cache,
embedding store) are sampled idle at the start, idle after `--warmup` seconds of traffic (the
RSS baseline), every `--sample-interval` seconds and idle at the end. Prints a JSON summary
(also written to `--out`) and a PASS/FAIL line: no 5xx, dropped connection or stream without
[DONE], healthy at the end, occupancy back to its start value, RSS growth since warm-up under
`--max-rss-growth`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import shlex
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction

import httpx
import numpy as np
from PIL import Image

WORDS = "the a picture of red blue cat dog left right count describe what is in this scene".split()
# /stats keys that must be back to their start value once the server is idle again
OCCUPANCY_KEYS = ("num_running", "num_waiting", "num_free_kv_blocks", "kv_cache_usage",
                  "encoder_cache_referenced", "num_streams")
REPORT_KEYS = OCCUPANCY_KEYS + ("encoder_cache_rows", "encoder_cache_entries",
                                "mm_embedding_entries", "mm_embedding_bytes_device",
                                "mm_embedding_bytes_host", "num_images_encoded",
                                "num_encoder_cache_hits", "num_encoder_cache_evictions",
                                "num_preemptions", "num_generated_tokens", "num_steps")


# ---- inputs -------------------------------------------------------------------------------


def _encode(img: Image.Image, fmt: str) -> str:
    buf = io.BytesIO()
    img.save(buf, fmt, **({"quality": 85} if fmt == "JPEG" else {}))
    mime = "jpeg" if fmt == "JPEG" else "png"
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def make_image(rng: np.random.Generator, sizes: list[tuple[int, int]]) -> str:
    w, h = sizes[int(rng.integers(len(sizes)))]
    # smooth gradient plus noise: realistic sizes for both formats
    base = np.linspace(0, 255, w, dtype=np.float32)[None, :, None] * rng.random(3)
    arr = np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
    return _encode(Image.fromarray(arr), "PNG" if rng.random() < 0.5 else "JPEG")


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


# ---- hostile inputs (issue 39) ------------------------------------------------------------

# Qwen-VL's placeholders: a raw prompt holding them and no images (and image data without them)
PLACEHOLDER_PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe."
                      "<|im_end|>\n<|im_start|>assistant\n")


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def png_16bit(width: int, height: int) -> bytes:
    """A 16-bit RGBA PNG of zeros (8 bytes a pixel once decoded; tests/multimodal/
    test_video_files.py's), small on the wire however large it decodes."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body)))

    z, row = zlib.compressobj(9), bytes(1 + width * 8)
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 16,
                                                             6, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def png_video(fmt: str, declared: int, frame: bytes) -> bytes:
    """A two-frame `fmt` file whose header declares `declared` x `declared` 16-bit RGBA
    frames, each packet the PNG `frame` (whatever size that one is)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream("png", rate=1)
        stream.width, stream.height, stream.pix_fmt = declared, declared, "rgba64be"
        for i in range(2):
            packet = av.Packet(frame)
            packet.stream, packet.pts, packet.dts = stream, i, i
            packet.time_base = Fraction(1, 1)
            out.mux(packet)
    return buf.getvalue()


class Embeddings:
    """A completion's client `multi_modal_embeddings` for `PLACEHOLDER_PROMPT` and one 84x56
    image, made as tests/e2e/test_server_hardening.py's `encoded` makes them (the served
    model's input processor, bytes handles of random rows), and the malformed variants of
    that test. Every `body()` is the same valid body: sent again, it is a client's retry."""

    def __init__(self, model: str, seed: int) -> None:
        import msgspec
        import torch

        from vlmserve.models.metadata import load_model_processor
        from vlmserve.models.registry import image_row_width
        from vlmserve.transfer.wire import BytesWire, output_to_wire

        _, hf_config, processor = load_model_processor(model)
        self.width = image_row_width(hf_config)
        gen = torch.Generator().manual_seed(seed)
        rng = np.random.default_rng(seed)
        image = Image.fromarray(rng.integers(0, 256, (56, 84, 3), np.uint8))
        processed = processor.process(PLACEHOLDER_PROMPT, None, [image])
        handles = []
        for i, img in enumerate(processed.images):
            rows = torch.randn(img.length, self.width, generator=gen)
            handles.append(BytesWire(handle_id=f"soak-{i}", shape=tuple(rows.shape),
                                     dtype="float32", release_address=None,
                                     expires_at=time.time() + 7 * 86400,
                                     data=self.rows(rows)))
        self.valid = json.loads(msgspec.json.encode(output_to_wire(processed, handles)))
        # one image's rows given for both of a prompt's two placeholders (served)
        self.twice_prompt = PLACEHOLDER_PROMPT.replace(
            "<|image_pad|>", "<|image_pad|><|vision_end|><|vision_start|><|image_pad|>", 1)
        twice = processor.process(self.twice_prompt, None, [image, image])
        self.twice = json.loads(msgspec.json.encode(output_to_wire(twice, handles * 2)))
        self.length = self.valid["images"][0]["length"]
        self.token_ids = processor.tokenizer.convert_tokens_to_ids(
            ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"])

    @staticmethod
    def rows(rows, name: str = "rows") -> bytes:
        from safetensors.torch import save

        return save({name: rows})

    def random_rows(self, n: int, width: int, name: str = "rows", dtype=None) -> str:
        import torch

        return base64.b64encode(self.rows(torch.randn(n, width).to(dtype or torch.float32),
                                          name)).decode()

    def body(self) -> dict:
        return json.loads(json.dumps(self.valid))

    def edited(self, edit) -> dict:
        mme = self.body()
        edit(mme)
        return mme

    def variants(self) -> list[tuple[str, object]]:
        """(name, edit of a valid body): each a 400."""
        n, w = self.length, self.width

        def handle(**fields):
            return lambda m: m["images"][0]["handle"].update(fields)

        def field_(path: str, value):
            def edit(m: dict) -> None:
                *head, last = path.split(".")
                d = m
                for k in head:
                    d = d[int(k)] if k.isdigit() else d[k]
                d[last] = value(d[last]) if callable(value) else value
            return edit

        def shm(segment: str):
            def edit(m: dict) -> None:
                h = m["images"][0]["handle"]
                m["images"][0]["handle"] = {
                    "kind": "shm", "handle_id": "s1", "shape": h["shape"], "dtype": "float32",
                    "release_address": None, "expires_at": h["expires_at"], "segment": segment}
            return edit

        def length_0(m: dict) -> None:
            field_("images.0.length", 0)(m)
            handle(shape=[0, w], data=self.random_rows(0, w))(m)

        return [
            ("not_safetensors", handle(data=base64.b64encode(b"not safetensors").decode())),
            ("no_rows_tensor", handle(data=self.random_rows(n, w, name="x"))),
            ("wrong_width", handle(shape=[n, w + 1], data=self.random_rows(n, w + 1))),
            ("wrong_dtype_rows", handle(data=self.random_rows(n, w, dtype=_float64()))),
            ("expired_lease", handle(expires_at=1.0)),
            ("float8_dtype", handle(dtype="float8_e4m3fn")),
            ("qint8_dtype", handle(dtype="qint8")),
            ("not_a_dtype", handle(dtype="Tensor")),
            ("shape_3d", handle(shape=[1, n, w])),
            ("shape_huge", handle(shape=[2_000_000, w], dtype="float64")),
            ("shape_2_70", handle(shape=[2**70, 1])),
            ("shape_negative", handle(shape=[-1, w])),
            ("one_row_broadcast", handle(data=self.random_rows(1, w))),
            ("position_offset_2_70", field_("position_offset", 2**70)),
            ("positions_2_rows", field_("prompt_positions", lambda p: p[:2])),
            ("positions_short", field_("prompt_positions", lambda p: [r[:-1] for r in p])),
            ("offset_past_prompt", field_("images.0.offset", 500)),
            ("offset_negative", field_("images.0.offset", -1)),
            ("length_0", length_0),
            ("grid_not_the_images", field_("images.0.encoder_meta", [1, 4, 4])),
            ("grid_negative", field_("images.0.encoder_meta", [1, -2, 3])),
            ("token_ids_not_the_prompts", field_("prompt_token_ids", lambda ids: ids[:-1])),
            ("cuda_handle", handle(kind="cuda")),
            ("shm_missing", shm("vlmserve-soak-no-such-segment")),
            ("shm_dotdot_x", shm("../x")),
            ("shm_slash", shm("a/b")),
            ("shm_dotdot", shm("..")),
            ("shm_nul", shm("a\x00b")),
            ("shm_empty", shm("")),
            ("shm_300_chars", shm("a" * 300)),
            ("no_images_listed", field_("images", [])),
            ("images_40", field_("images", lambda i: i * 40)),
        ]


def _float64():
    import torch

    return torch.float64


@dataclass
class Case:
    """One request to send: `expect` lists the statuses that are correct for it."""

    kind: str
    path: str
    body: dict | None = None
    raw: bytes | None = None  # sent as is (invalid JSON)
    expect: tuple[int, ...] = (200,)
    stream: bool = False
    abort_after: int | None = None  # close the stream after this many chunks
    abandon_after: float | None = None  # give up a non-streaming request after s seconds


class Traffic:
    def __init__(self, args: argparse.Namespace, model: str, max_model_len: int) -> None:
        self.args, self.model, self.max_model_len = args, model, max_model_len
        self.rng = random.Random(args.seed)
        self.np_rng = np.random.default_rng(args.seed)
        self.sizes = [tuple(int(v) for v in s.split("x")) for s in args.image_sizes.split(",")]
        self.pool = [make_image(self.np_rng, self.sizes) for _ in range(args.image_pool)]
        self.embeddings = None
        if args.hostile:
            try:  # the served model's processor, here: for client embeddings
                self.embeddings = Embeddings(model, args.seed)
            except Exception as e:  # noqa: BLE001 - an attached server's model may be elsewhere
                print(f"no multi_modal_embeddings cases: {type(e).__name__}: {e}",
                      file=sys.stderr, flush=True)
        self.bad_cases = [(name, fn) for name, fn, crasher in self._bad_cases()
                          if args.include_known_crashers or not crasher]

    def image(self) -> str:
        if self.rng.random() < 0.5:
            return self.rng.choice(self.pool)
        return make_image(self.np_rng, self.sizes)  # new content: an encoder cache miss

    def chat_body(self, stream: bool, n_images: int | None = None) -> dict:
        r = self.rng
        n_images = r.choice((0, 1, 1, 2, 3)) if n_images is None else n_images
        parts: list[dict] = [{"type": "image_url", "image_url": {"url": self.image()}}
                             for _ in range(n_images)]
        parts.append({"type": "text", "text": _text(r, r.randint(3, 40))})
        body: dict = {"model": self.model, "messages": [{"role": "user", "content": parts}],
                      "max_tokens": r.randint(1, self.args.max_tokens), "stream": stream}
        self._sampling(body)
        if stream and r.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        return body

    def _sampling(self, body: dict) -> None:
        r = self.rng
        body["temperature"] = r.choice((0.0, 0.7, 1.0, 1.5))
        if r.random() < 0.3:
            body["top_p"] = r.choice((0.1, 0.5, 0.9))
        if r.random() < 0.3:
            body["top_k"] = r.choice((1, 5, 50))
        if r.random() < 0.3:
            body["seed"] = r.randint(0, 2**32)
        if r.random() < 0.2:
            body["ignore_eos"] = True
        if r.random() < 0.1:
            body["stop"] = [r.choice(WORDS)]

    def next_case(self) -> Case:
        r, a = self.rng, self.args
        if r.random() < a.bad_fraction:
            name, fn = r.choice(self.bad_cases)
            case = fn()
            case.kind = "bad:" + name
            return case
        if r.random() < a.abort_fraction:
            if r.random() < 0.7:
                body = self.chat_body(True)
                body["max_tokens"] = a.max_tokens
                body["ignore_eos"] = True
                return Case("abort:stream", "/v1/chat/completions", body, stream=True,
                            abort_after=r.randint(0, 8))
            return Case("abort:nonstream", "/v1/chat/completions", self.chat_body(False),
                        abandon_after=r.uniform(0.01, 1.0))
        x = r.random()
        if x < 0.5:
            return Case("chat:stream", "/v1/chat/completions", self.chat_body(True), stream=True)
        if x < 0.8:
            return Case("chat", "/v1/chat/completions", self.chat_body(False))
        stream = r.random() < 0.5
        body = {"model": self.model, "prompt": _text(r, r.randint(1, 60)), "stream": stream,
                "max_tokens": r.randint(1, a.max_tokens)}
        self._sampling(body)
        return Case("completion" + (":stream" if stream else ""), "/v1/completions", body,
                    stream=stream)

    def _bad_cases(self) -> list:
        """(name, make_case, known_crasher): bad or edge-case inputs with their statuses."""
        chat, comp = "/v1/chat/completions", "/v1/completions"
        r = self.rng

        def chat_with(_expect=(400,), _images=None, **kw):
            def make() -> Case:
                body = self.chat_body(r.random() < 0.5, n_images=_images)
                body.update(kw)
                return Case("", chat, body, expect=_expect, stream=bool(body.get("stream")))
            return make

        def image_url(url: str, expect=(400,)):
            def make() -> Case:
                body = self.chat_body(False, n_images=0)
                body["messages"][0]["content"].insert(
                    0, {"type": "image_url", "image_url": {"url": url}})
                return Case("", chat, body, expect=expect)
            return make

        png = base64.b64decode(self.pool[0].split(",", 1)[1]) if self.pool else b""
        many = "hello " * (32 * self.max_model_len // 6 + 10)  # over --max-prompt-chars
        long_tokens = " ".join(["hello"] * (self.max_model_len + 50))  # over the context
        bomb = io.BytesIO()
        Image.new("L", (9000, 9000)).save(bomb, "PNG")  # 81 Mpx: over --max-image-pixels
        bomb_url = "data:image/png;base64," + base64.b64encode(bomb.getvalue()).decode()
        return [
            ("invalid_json", lambda: Case("", chat, raw=b'{"model": "x", "messages": [',
                                          expect=(400, 422)), False),
            ("not_an_object", lambda: Case("", chat, raw=b"[1, 2, 3]", expect=(400, 422)),
             False),
            ("nan_temperature", lambda: Case("", comp, raw=json.dumps(
                {"model": self.model, "prompt": "hi", "temperature": float("nan")}).encode(),
                expect=(400,)), False),
            ("unknown_field", chat_with(foo_bar=1), False),
            ("response_format", chat_with(response_format={"type": "json_object"},
                                           _expect=(200,)), False),
            ("n_2", chat_with(n=2, _expect=(200,)), False),
            ("top_logprobs_21", chat_with(logprobs=True, top_logprobs=21), False),
            ("bad_type_max_tokens", chat_with(max_tokens="ten"), False),
            ("empty_messages", chat_with(messages=[]), False),
            ("bad_part_type", chat_with(messages=[{"role": "user", "content": [
                {"type": "video", "video": "x"}]}]), False),
            ("wrong_model", chat_with(model="no-such-model", _expect=(404,)), False),
            ("huge_max_tokens", chat_with(max_tokens=10**9), False),
            ("huger_max_tokens", chat_with(max_tokens=2**70), False),
            ("zero_max_tokens", chat_with(max_tokens=0), False),
            ("negative_temperature", chat_with(temperature=-1.0), False),
            ("big_temperature", chat_with(temperature=1e6), False),
            ("bad_top_p", chat_with(top_p=1.5), False),
            ("zero_top_p", chat_with(top_p=0.0), False),
            ("bad_top_k", chat_with(top_k=-5), False),
            ("negative_stop_token", chat_with(stop_token_ids=[-1]), False),
            ("seed_2_64", chat_with(seed=2**64), True),
            ("seed_2_70", chat_with(seed=2**70 + 3), True),
            ("seed_below_min", chat_with(seed=-(2**63) - 1), True),
            # valid edge values: must be served
            ("seed_max", chat_with(seed=2**64 - 1, _expect=(200,)), True),
            ("seed_min", chat_with(seed=-(2**63), _expect=(200,)), True),
            ("tiny_temperature", chat_with(temperature=1e-40, _expect=(200,)), True),
            ("tiny_top_p", chat_with(top_p=1e-30, _expect=(200,)), True),
            ("too_long_prompt_chars", lambda: Case("", comp, {"model": self.model,
                                                              "prompt": many}, expect=(400,)),
             False),
            ("too_long_prompt_tokens", lambda: Case("", comp, {"model": self.model,
                                                               "prompt": long_tokens},
                                                    expect=(400,)), False),
            ("bad_image_base64", image_url("data:image/png;base64,@@not-base64@@"), False),
            ("bad_image_bytes", image_url("data:image/png;base64,"
                                          + base64.b64encode(os.urandom(512)).decode()), False),
            ("truncated_png", image_url("data:image/png;base64,"
                                        + base64.b64encode(png[: len(png) // 2]).decode()),
             False),
            ("remote_image", image_url("http://127.0.0.1:9/x.png"), False),
            ("local_image", image_url("file:///etc/passwd"), False),
            ("image_too_many_pixels", image_url(bomb_url), False),
            ("too_many_images", chat_with(_images=9, max_tokens=1, _expect=(400,)), False),
        ] + (self._hostile_cases() if self.args.hostile else [])

    def _hostile_cases(self) -> list:
        """Issue 39's second battery: structured outputs, tools, sampling values, client
        embeddings, placeholders without images, tiny and lying videos, chat template
        arguments. A 400 unless a 200 is also right (valid edge inputs); never a 5xx."""
        chat, comp = "/v1/chat/completions", "/v1/completions"
        r, either = self.rng, (200, 400)

        def chat_with(_expect=(400,), _images=0, **kw):
            def make() -> Case:
                body = self.chat_body(r.random() < 0.5, n_images=_images)
                body["max_tokens"] = min(body["max_tokens"], 8)
                body.update(kw)
                return Case("", chat, body, expect=_expect, stream=bool(body.get("stream")))
            return make

        def complete(_expect=(400,), **kw):
            def make() -> Case:
                body = {"model": self.model, "prompt": _text(r, 5), "max_tokens": 4,
                        "stream": r.random() < 0.5, **kw}
                return Case("", comp, body, expect=_expect, stream=body["stream"])
            return make

        def media(kind: str, url: str, expect=(400,), **kw):
            def make() -> Case:
                body = self.chat_body(r.random() < 0.5, n_images=0)
                body["max_tokens"] = min(body["max_tokens"], 8)
                body["messages"][0]["content"].insert(0, {"type": kind, kind: {"url": url}})
                body.update(kw)
                return Case("", chat, body, expect=expect, stream=bool(body.get("stream")))
            return make

        def so(**spec):
            return {"structured_outputs": spec}

        big_schema = {"type": "object", "properties": {
            f"field_{i:05d}": {"type": "string", "description": "x" * 40} for i in range(5000)}}
        deep_string = '{"type": "array", "items": ' * 500 + "{}" + "}" * 500
        tool = {"type": "function", "function": {"name": "get", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
        tools = [{"type": "function", "function": {**tool["function"], "name": f"f{i}"}}
                 for i in range(2000)]
        one_by_one = io.BytesIO()
        Image.new("RGB", (1, 1), (200, 10, 10)).save(one_by_one, "PNG")
        from vlmserve.benchmarks.client import video_data_url

        tiny_video = video_data_url(4, 32, np.random.default_rng(self.args.seed))
        frame = png_16bit(4000, 4000)  # 128 MB decoded, ~130 KB as a file
        lying = {f"{fmt}{d}": "data:video/mp4;base64," + base64.b64encode(
            png_video(fmt, d, frame)).decode() for fmt, d in (("nut", 4000), ("avi", 4000),
                                                                ("nut", 64))}
        cases = [
            # structured outputs and tools (issue 39, items 3, 5 and 10)
            ("schema_oversized_dict", chat_with(**so(json=big_schema)), False),
            ("schema_oversized_response_format", chat_with(response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": big_schema}}),
             False),
            ("schema_nested_500_dict", chat_with(**so(json=nested_schema(500))), False),
            ("schema_nested_500_string", chat_with(**so(json=deep_string)), False),
            ("schema_brackets_1200_string", chat_with(**so(json="[" * 1200 + "]" * 1200)),
             False),
            ("guided_json_nested_500_string", chat_with(guided_json=deep_string), False),
            ("regex_unsatisfiable", chat_with(**so(regex=r"[^\s\S]")), False),
            ("regex_unsatisfiable_alternatives", chat_with(**so(regex=r"ab[^\d\D]c|x{0}[^\w\W]")),
             False),
            ("regex_invalid", chat_with(**so(regex="(unclosed")), False),
            ("choice_5000", chat_with(**so(choice=[f"option {i}" for i in range(5000)])), False),
            ("choice_valid", chat_with(**so(choice=["yes", "no"]), _expect=(200,)), False),
            ("tools_2000_required", chat_with(tools=tools, tool_choice="required"), False),
            ("tools_2000_named", chat_with(tools=tools, tool_choice={
                "type": "function", "function": {"name": "f7"}}), False),
            ("tools_required_valid", chat_with(tools=[tool], tool_choice="required",
                                               _expect=(200,)), False),
            # sampling values
            ("stop_token_ids_2_70", chat_with(stop_token_ids=[2**70]), False),
            ("stop_token_ids_2_70_completion", complete(stop_token_ids=[2**70]), False),
            ("n_huge", chat_with(n=10**9), False),
            ("n_2_70", chat_with(n=2**70), False),
            ("n_zero", chat_with(n=0), False),
            ("logit_bias_out_of_range", chat_with(logit_bias={"1": 1e6}), False),
            ("logit_bias_negative_out_of_range", chat_with(logit_bias={"1": -101}), False),
            ("logit_bias_not_a_token", chat_with(logit_bias={"99999999": 1}), False),
            ("logit_bias_not_an_id", chat_with(logit_bias={"x": 1}), False),
            ("logit_bias_2_70", chat_with(logit_bias={str(2**70): 1}), False),
            # placeholders without images (raw prompts, token ids), in a chat's text
            ("raw_prompt_placeholders", complete(prompt=PLACEHOLDER_PROMPT), False),
            ("chat_text_placeholders", chat_with(messages=[{"role": "user", "content":
                                                            PLACEHOLDER_PROMPT}],
                                                 _expect=either), False),
            # images and videos
            ("image_1x1", media("image_url", "data:image/png;base64," + base64.b64encode(
                one_by_one.getvalue()).decode(), expect=either), False),
            ("video_tiny", media("video_url", tiny_video, expect=(200,)), False),
            ("video_huge_frame_nut", media("video_url", lying["nut4000"]), False),
            ("video_huge_frame_avi", media("video_url", lying["avi4000"]), False),
            ("video_frame_lies", media("video_url", lying["nut64"]), False),
            ("video_fps_huge", media("video_url", tiny_video, expect=either,
                                     mm_processor_kwargs={"fps": 1e9}), False),
            ("video_num_frames_huge", media("video_url", tiny_video, expect=either,
                                            mm_processor_kwargs={"num_frames": 10**9}), False),
            # chat_template_kwargs
            ("template_kwargs_reserved_messages", chat_with(chat_template_kwargs={
                "messages": [{"role": "system", "content": "x"}]}), False),
            ("template_kwargs_reserved_tools", chat_with(chat_template_kwargs={
                "tools": "x"}), False),
            ("template_kwargs_reserved_generation", chat_with(chat_template_kwargs={
                "add_generation_prompt": False}), False),
            ("template_continue_and_generate", chat_with(continue_final_message=True,
                                                         add_generation_prompt=True), False),
            ("template_kwargs_not_a_dict", chat_with(chat_template_kwargs=[1, 2]), False),
            ("template_kwargs_100k_unused", chat_with(chat_template_kwargs={
                "enable_thinking": False, "x": "y" * 100_000}, _expect=either), False),
            ("template_kwargs_nested_500", chat_with(chat_template_kwargs={
                "x": nested_schema(500)}, _expect=either), False),
        ]
        if self.embeddings is not None:
            cases += self._embedding_cases(comp)
        return cases

    def _embedding_cases(self, comp: str) -> list:
        """A completion's client `multi_modal_embeddings`: valid (and the same body again, a
        retry; one image's rows listed twice), malformed (a 400 each), without the prompt's
        placeholders, and placeholders in token ids without embeddings."""
        emb, r = self.embeddings, self.rng
        start, pad, end, video_pad = emb.token_ids

        def complete(mme: object, expect=(400,), prompt: object = PLACEHOLDER_PROMPT):
            def make() -> Case:
                m = mme() if callable(mme) else mme
                body = {"model": self.model, "prompt": prompt, "max_tokens": r.randint(1, 8),
                        "stream": r.random() < 0.5, "multi_modal_embeddings": m}
                if m is None:
                    del body["multi_modal_embeddings"]
                return Case("", comp, body, expect=expect, stream=body["stream"])
            return make

        cases = [
            ("embeddings_valid", complete(emb.body, expect=(200,)), False),
            ("embeddings_image_listed_twice", complete(
                lambda: json.loads(json.dumps(emb.twice)), expect=(200,),
                prompt=emb.twice_prompt), False),
            ("embeddings_without_placeholders", complete(emb.body, prompt="Describe."), False),
            ("embeddings_token_id_prompt", complete(emb.body, prompt=[1, 2, 3]), False),
            ("token_ids_placeholders_no_images", complete(
                None, prompt=[start, pad, pad, pad, end, 13]), False),
            ("token_ids_video_placeholders_no_videos", complete(
                None, prompt=[start, video_pad, end, 13]), False),
        ]
        for name, edit in emb.variants():
            cases.append((f"embeddings_{name}", complete(
                lambda edit=edit: emb.edited(edit)), False))
        return cases


# ---- the server -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_tree(root: int) -> list[int]:
    """`root`, the processes of its process group and all their descendants (live ones)."""
    parent, group = {}, {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(d)], group[int(d)] = int(fields[1]), int(fields[2])
    tree = {root} | {p for p, g in group.items() if g == root}
    grew = True
    while grew:
        more = {p for p, pp in parent.items() if pp in tree} - tree
        tree |= more
        grew = bool(more)
    return sorted(p for p in tree if p in parent)


def memory(root: int | None) -> dict | None:
    """Summed RSS and PSS (MiB) of the server's process tree, and RSS per process."""
    if root is None:
        return None
    rss = pss = 0
    procs = {}
    for pid in process_tree(root):
        try:
            with open(f"/proc/{pid}/status") as f:
                kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            try:
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    pss += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
            except (OSError, StopIteration):
                pass
        except (OSError, StopIteration):
            continue
        rss += kb
        procs[str(pid)] = {"rss_mib": round(kb / 1024, 1), "cmd": cmd[:80]}
    if not procs:
        return None
    return {"rss_mib": round(rss / 1024, 1), "pss_mib": round(pss / 1024, 1),
            "num_processes": len(procs), "processes": procs}


def start_server(args: argparse.Namespace, port: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vlmserve", "serve", args.model, "--port", str(port),
           *shlex.split(args.server_args)]
    print("starting:", shlex.join(cmd), file=sys.stderr, flush=True)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_server(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    try:  # stragglers of the group (workers whose parent died first)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ---- the run ------------------------------------------------------------------------------


@dataclass
class Tally:
    sent: Counter = field(default_factory=Counter)  # kind -> requests
    status: Counter = field(default_factory=Counter)  # (kind, status) -> count
    unexpected: Counter = field(default_factory=Counter)  # (kind, status) -> count
    stream_errors: Counter = field(default_factory=Counter)  # kind -> streams without [DONE]
    transport: Counter = field(default_factory=Counter)  # (kind, exception) -> count
    aborts: int = 0
    examples: list = field(default_factory=list)  # first few failures, for the report

    def note(self, what: str) -> None:
        if len(self.examples) < 20:
            self.examples.append(what[:700])


def stream_error_status(event: str) -> int:
    """The status a stream's error event stands for: its `code` where it is one, else 400
    for an `invalid_request_error` and 500 for anything else (a `server_error`)."""
    try:
        error = json.loads(event)["error"]
    except (ValueError, KeyError, TypeError):
        return 500
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, int) and 400 <= code < 600:
        return code
    return 400 if isinstance(error, dict) and error.get("type") == "invalid_request_error" \
        else 500


async def send(client: httpx.AsyncClient, case: Case, tally: Tally, timeout: float) -> None:
    tally.sent[case.kind] += 1
    kw: dict = {"content": case.raw, "headers": {"content-type": "application/json"}} \
        if case.raw is not None else {"json": case.body}
    status = None
    try:
        if case.abandon_after is not None:
            try:
                r = await asyncio.wait_for(client.post(case.path, **kw), case.abandon_after)
                status, text = r.status_code, r.text
            except TimeoutError:
                tally.aborts += 1
                return
        elif case.stream:
            async with client.stream("POST", case.path, timeout=timeout, **kw) as r:
                status = r.status_code
                if status != 200:
                    await r.aread()
                    text = r.text
                else:
                    chunks, done, err, after_done = 0, False, None, False
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[6:]
                        if done:  # nothing may follow [DONE]
                            after_done = True
                            break
                        if data == "[DONE]":
                            done = True
                            continue
                        if data.startswith('{"error"'):
                            err = data
                        chunks += 1
                        if case.abort_after is not None and chunks >= case.abort_after:
                            tally.aborts += 1
                            return  # leaving the block closes the connection mid-stream
                    text = err or ""
                    if not done or after_done:
                        # a stream, failed or not, ends with [DONE] (after its error event)
                        tally.stream_errors[case.kind] += 1
                        tally.note(f"{case.kind}: stream "
                                   f"{'with events after [DONE]' if done else 'without [DONE]'}"
                                   f"{': ' + err if err else ''}; body "
                                   f"{json.dumps(case.body)[:200] if case.body else case.raw}")
                    elif err:  # failed after its 200: the error event's status counts
                        status = stream_error_status(err)
        else:
            r = await client.post(case.path, timeout=timeout, **kw)
            status, text = r.status_code, r.text
    except (httpx.HTTPError, OSError) as e:
        tally.transport[(case.kind, type(e).__name__)] += 1
        tally.note(f"{case.kind}: {type(e).__name__}: {e}")
        return
    tally.status[(case.kind, status)] += 1
    if status not in case.expect:
        tally.unexpected[(case.kind, status)] += 1
        body = json.dumps(case.body)[:300] if case.body is not None else repr(case.raw[:300])
        tally.note(f"{case.kind}: HTTP {status} (expected {case.expect}): {text[:300]}; "
                   f"body {body}")


async def get_json(client: httpx.AsyncClient, path: str) -> dict | None:
    try:
        r = await client.get(path, timeout=30)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def sample(client: httpx.AsyncClient, root: int | None, t0: float, label: str) -> dict:
    stats = await get_json(client, "/stats")
    try:
        healthy = stats is not None and (await client.get("/health", timeout=30)).status_code == 200
    except httpx.HTTPError:
        healthy = False
    s = {"label": label, "t_s": round(time.perf_counter() - t0, 1), "healthy": healthy,
         "memory": memory(root),
         "stats": {k: stats.get(k) for k in REPORT_KEYS} if stats else None}
    mem = s["memory"] or {}
    print(f"[{s['t_s']:7.1f}s] {label:6s} healthy={s['healthy']} rss={mem.get('rss_mib')}MiB "
          f"pss={mem.get('pss_mib')}MiB stats={json.dumps(s['stats'])}", file=sys.stderr,
          flush=True)
    return s


async def wait_idle(client: httpx.AsyncClient, timeout: float) -> bool:
    end = time.perf_counter() + timeout
    while time.perf_counter() < end:
        s = await get_json(client, "/stats")
        if s is None:
            return False
        if s.get("num_running") == 0 and s.get("num_waiting") == 0 \
                and s.get("num_streams", 0) == 0:
            return True
        await asyncio.sleep(0.5)
    return False


async def run(args: argparse.Namespace, url: str, root: int | None, alive) -> dict:
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=args.request_timeout) as c:
        models = await get_json(c, "/v1/models")
        card = models["data"][0]
        traffic = Traffic(args, card["id"], card.get("max_model_len") or 1024)
        tally, samples = Tally(), []
        t0 = time.perf_counter()
        samples.append(await sample(c, root, t0, "start"))
        gate = asyncio.Event()
        gate.set()
        deadline = t0 + args.duration
        in_flight, dead_at = 0, None

        def going() -> bool:
            return time.perf_counter() < deadline and dead_at is None and alive()

        async def client_loop() -> None:
            nonlocal in_flight
            while going():
                await gate.wait()
                case = traffic.next_case()
                in_flight += 1
                try:
                    await send(c, case, tally, args.request_timeout)
                finally:
                    in_flight -= 1

        async def sampler() -> None:
            nonlocal dead_at
            warm_at = t0 + min(args.warmup, args.duration / 2)
            next_at = t0 + args.sample_interval
            warmed, failures = False, 0
            while going():
                await asyncio.sleep(1.0)
                try:  # a server that stays unhealthy (engine core dead) ends the run early
                    healthy = (await c.get("/health", timeout=30)).status_code == 200
                except httpx.HTTPError:
                    healthy = False
                failures = 0 if healthy else failures + 1
                if failures >= 3 or not alive():
                    dead_at = round(time.perf_counter() - t0, 1)
                    print(f"[{dead_at:7.1f}s] server unhealthy or gone: stopping the run",
                          file=sys.stderr, flush=True)
                    break
                now = time.perf_counter()
                if not warmed and now >= warm_at:  # pause the clients, drain, sample idle
                    warmed = True
                    gate.clear()
                    while in_flight:
                        await asyncio.sleep(0.1)
                    await wait_idle(c, args.drain_timeout)
                    await asyncio.sleep(args.idle)
                    samples.append(await sample(c, root, t0, "warm"))
                    gate.set()
                    next_at = time.perf_counter() + args.sample_interval
                elif now >= next_at:
                    next_at = now + args.sample_interval
                    samples.append(await sample(c, root, t0, "run"))

        await asyncio.gather(sampler(), *(client_loop() for _ in range(args.concurrency)))
        wall = time.perf_counter() - t0
        drained = await wait_idle(c, args.drain_timeout)
        await asyncio.sleep(args.idle)
        samples.append(await sample(c, root, t0, "end"))
        probe = Case("probe", "/v1/chat/completions", traffic.chat_body(False, n_images=1))
        probe_tally = Tally()
        await send(c, probe, probe_tally, args.request_timeout)
        probe_ok = probe_tally.status[("probe", 200)] == 1
    summary = summarize(args, tally, samples, wall, drained, probe_ok)
    summary["server_died_at_s"] = dead_at
    return summary


def summarize(args, tally: Tally, samples: list[dict], wall: float, drained: bool,
              probe_ok: bool) -> dict:
    by_status: Counter = Counter()
    for (_, status), n in tally.status.items():
        by_status[status] += n
    expected_4xx = sum(n for (k, s), n in tally.status.items()
                       if 400 <= s < 500 and (k, s) not in tally.unexpected)
    n5xx = sum(n for s, n in by_status.items() if s >= 500)
    start, end = samples[0], samples[-1]
    warm = next((s for s in samples if s["label"] == "warm"), start)

    def series(key: str) -> dict:
        vals = [s["stats"][key] for s in samples if s["stats"] and s["stats"].get(key) is not None]
        return {"start": start["stats"] and start["stats"].get(key),
                "end": end["stats"] and end["stats"].get(key),
                "max": max(vals) if vals else None}

    occupancy = {k: series(k) for k in REPORT_KEYS}
    occ_back = bool(start["stats"] and end["stats"]) and all(
        end["stats"].get(k) == start["stats"].get(k) for k in OCCUPANCY_KEYS)
    rss = {lab: s["memory"] and s["memory"]["rss_mib"] for lab, s in
           (("start", start), ("warm", warm), ("end", end))}
    pss = {lab: s["memory"] and s["memory"]["pss_mib"] for lab, s in
           (("start", start), ("warm", warm), ("end", end))}
    mems = [s["memory"]["rss_mib"] for s in samples if s["memory"]]
    rss["max"] = max(mems) if mems else None
    growth = (rss["end"] - rss["warm"]) / rss["warm"] if rss["end"] and rss["warm"] else None
    checks = {
        "no_5xx": n5xx == 0,
        "no_transport_or_stream_errors": not tally.transport and not tally.stream_errors,
        "healthy_at_end": end["healthy"] and probe_ok and drained,
        "occupancy_back_to_start": occ_back,
        "rss_growth_ok": growth is None or growth <= args.max_rss_growth,
    }
    ok = all(checks.values())
    return {
        "duration_s": round(wall, 1), "concurrency": args.concurrency,
        "include_known_crashers": args.include_known_crashers,
        "requests_sent": sum(tally.sent.values()),
        "requests_per_s": round(sum(tally.sent.values()) / wall, 2),
        "served_2xx": sum(n for s, n in by_status.items() if 200 <= s < 300),
        "aborts": tally.aborts,
        "status_counts": {str(s): n for s, n in sorted(by_status.items())},
        "expected_4xx": expected_4xx,
        "unexpected": {f"{k} {s}": n for (k, s), n in sorted(tally.unexpected.items())},
        "http_5xx": n5xx,
        "stream_errors": dict(tally.stream_errors),
        "transport_errors": {f"{k} {e}": n for (k, e), n in tally.transport.items()},
        "sent_by_kind": dict(sorted(tally.sent.items())),
        "status_by_kind": {k: {str(st): n for (kk, st), n in sorted(tally.status.items())
                               if kk == k} for k in sorted(tally.sent)},
        "rss_mib": rss, "pss_mib": pss,
        "rss_growth_since_warmup": None if growth is None else round(growth, 4),
        "occupancy": occupancy,
        "checks": checks,
        "result": "PASS" if ok else "FAIL",
        "failure_examples": tally.examples,
        "samples": samples,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-qwen2-vl")
    ap.add_argument("--url", help="attach to a running server instead of starting one")
    ap.add_argument("--server-pid", type=int, help="with --url: the server's pid, for RSS")
    ap.add_argument("--server-args", default="", help="extra `vlmserve serve` flags")
    ap.add_argument("--port", type=int, help="port of the started server (default: a free one)")
    ap.add_argument("--server-log", help="started server's output (default: a temp file)")
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--duration", type=float, default=600)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64, help="largest max_tokens of a request")
    ap.add_argument("--bad-fraction", type=float, default=0.15)
    ap.add_argument("--abort-fraction", type=float, default=0.1)
    ap.add_argument("--image-sizes", default="56x56,112x84,224x224,320x240,448x336,200x400")
    ap.add_argument("--image-pool", type=int, default=16, help="images reused across requests")
    ap.add_argument("--include-known-crashers", action=argparse.BooleanOptionalAction,
                    default=True, help="send the inputs that used to kill the engine core")
    ap.add_argument("--hostile", action=argparse.BooleanOptionalAction, default=True,
                    help="also send issue 39's inputs (structured outputs, tools, client "
                    "embeddings, videos, template arguments)")
    ap.add_argument("--warmup", type=float, default=60, help="seconds before the RSS baseline")
    ap.add_argument("--sample-interval", type=float, default=30)
    ap.add_argument("--idle", type=float, default=5, help="idle seconds before idle samples")
    ap.add_argument("--drain-timeout", type=float, default=60)
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--max-rss-growth", type=float, default=0.10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the summary here (JSON)")
    args = ap.parse_args()

    proc = log = None
    if args.url:
        url, root = args.url.rstrip("/"), args.server_pid
        alive = lambda: root is None or os.path.exists(f"/proc/{root}")  # noqa: E731
    else:
        port = args.port or free_port()
        url = f"http://127.0.0.1:{port}"
        log_path = args.server_log or tempfile.mkstemp(prefix="soak_server_", suffix=".log")[1]
        log = open(log_path, "wb")  # noqa: SIM115 - open for the server's lifetime
        proc = start_server(args, port, log)
        root = proc.pid
        alive = lambda: proc.poll() is None  # noqa: E731
        end = time.time() + args.startup_timeout
        while True:
            if proc.poll() is not None:
                sys.exit(f"server exited with {proc.returncode}; see {log_path}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > end:
                stop_server(proc)
                sys.exit(f"server not healthy after {args.startup_timeout}s; see {log_path}")
            time.sleep(1)
    try:
        summary = asyncio.run(run(args, url, root, alive))
    finally:
        if proc is not None:
            stop_server(proc)
            log.close()
    if proc is not None:
        with open(log_path, errors="replace") as f:
            text = f.read()
        summary["server_log"] = {"path": log_path, "tracebacks": text.count("Traceback"),
                                 "error_lines": sum(" ERROR " in ln or ln.startswith("ERROR")
                                                    for ln in text.splitlines()),
                                 "exit_code": proc.returncode}
    brief = {k: v for k, v in summary.items() if k not in ("samples", "occupancy")}
    brief["occupancy"] = {k: summary["occupancy"][k] for k in OCCUPANCY_KEYS
                          + ("encoder_cache_entries", "mm_embedding_entries")}
    print(json.dumps(brief, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    print(f"{summary['result']}: " + ", ".join(f"{k}={v}" for k, v in summary["checks"].items()))
    sys.exit(0 if summary["result"] == "PASS" else 1)


if __name__ == "__main__":
    main()
