"""Bounded soak benchmark: mixed streaming traffic, client aborts and bad inputs (issue 21).

    python benchmarks/soak.py --model tiny-qwen2-vl --duration 600 \\
        --server-args "--dtype float32 --device cpu --max-model-len 1024" --out soak.json
    python benchmarks/soak.py --url http://127.0.0.1:8000 --server-pid PID   # attach

Starts `python -m vlmserve serve MODEL` in its own process group (or attaches to `--url`), then
`--concurrency` clients send, for `--duration` seconds, a mix of streaming and non-streaming
chat requests with 0-3 images (PNG/JPEG data URLs of varied sizes, half drawn from a small
pool so the encoder cache hits), text completions, streams the client closes after k chunks,
non-streaming requests it abandons, and bad inputs (invalid JSON, unsupported fields, bad image
bytes, over-long prompts, out-of-range sampling values, a wrong model name), each with the
statuses it may get. The server's process tree RSS/PSS (from /proc) and its `/stats` (KV blocks,
encoder cache, embedding store) are sampled idle at the start, idle after `--warmup` seconds of
traffic (the RSS baseline), every `--sample-interval` seconds and idle at the end. Prints a JSON
summary (also written to `--out`) and a PASS/FAIL line: no 5xx or dropped connection, healthy
at the end, occupancy back to its start value, RSS growth since warm-up under `--max-rss-growth`.
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
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

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
            ("response_format", chat_with(response_format={"type": "json_object"}), False),
            ("n_2", chat_with(n=2), False),
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
        ]


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
    stream_errors: Counter = field(default_factory=Counter)  # kind -> 200 streams that failed
    transport: Counter = field(default_factory=Counter)  # (kind, exception) -> count
    aborts: int = 0
    examples: list = field(default_factory=list)  # first few failures, for the report

    def note(self, what: str) -> None:
        if len(self.examples) < 20:
            self.examples.append(what[:400])


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
                    chunks, done, err = 0, False, None
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[6:]
                        if data == "[DONE]":
                            done = True
                            break
                        if data.startswith('{"error"'):
                            err = data
                        chunks += 1
                        if case.abort_after is not None and chunks >= case.abort_after:
                            tally.aborts += 1
                            return  # leaving the block closes the connection mid-stream
                    if err or not done:
                        tally.stream_errors[case.kind] += 1
                        tally.note(f"{case.kind}: stream {'error ' + err if err else 'no [DONE]'}")
                    text = ""
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
        tally.note(f"{case.kind}: HTTP {status} (expected {case.expect}): {text[:300]}")


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
