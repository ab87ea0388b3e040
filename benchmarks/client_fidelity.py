"""Does the benchmark client measure the server or itself? A paced fake OpenAI chat server
(one token to every open stream each `--step-ms`, like an engine step; it records its own
gaps between a stream's tokens) in a process of its own, and `vlmserve bench serve`'s client
against it at each concurrency; `--openai` adds the `openai` SDK client the benchmark used
before, for comparison. Both sides' gaps in one table (CPU only).

    python benchmarks/client_fidelity.py [--concurrency 16,64,192] [--openai]
"""

import argparse
import asyncio
import json
import subprocess
import sys
import time
import urllib.request

STEP_MS = 3.0


def serve(port: int, step_ms: float) -> None:
    """The fake server (runs in its own process)."""
    import uvicorn

    open_streams: set[asyncio.Queue] = set()
    gaps: list[float] = []

    async def ticker():
        while True:
            await asyncio.sleep(step_ms / 1e3)
            now = time.perf_counter()
            for q in list(open_streams):
                q.put_nowait(now)

    async def respond(send, body: bytes, status: int = 200) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    def event(obj: dict) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                asyncio.get_running_loop().create_task(ticker())
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"].endswith("/models"):
            return await respond(send, json.dumps({"object": "list", "data": [
                {"id": "fake", "object": "model", "created": 0, "owned_by": "x"}]}).encode())
        if scope["path"].endswith("/gaps"):  # the server's own gaps since the last call
            g = sorted(gaps) or [0.0]
            gaps.clear()
            return await respond(send, json.dumps({
                "mean_ms": 1e3 * sum(g) / len(g), "p99_ms": 1e3 * g[int(0.99 * (len(g) - 1))]
            }).encode())
        if not scope["path"].endswith("/chat/completions"):  # e.g. /metrics: not this server
            return await respond(send, b"{}", 404)
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        n = json.loads(body).get("max_tokens", 16)  # parsed, as a real server must
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        q: asyncio.Queue = asyncio.Queue()
        open_streams.add(q)
        last = None
        try:
            for _ in range(n):
                t = await q.get()
                if last is not None:
                    gaps.append(t - last)
                last = t
                await send({"type": "http.response.body", "more_body": True, "body": event({
                    "id": "x", "object": "chat.completion.chunk", "created": 0, "model": "fake",
                    "choices": [{"index": 0, "delta": {"content": "a"},
                                 "finish_reason": None}]})})
            usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
            await send({"type": "http.response.body", "body": event({
                "id": "x", "object": "chat.completion.chunk", "created": 0, "model": "fake",
                "choices": [], "usage": usage}) + b"data: [DONE]\n\n"})
        finally:
            open_streams.discard(q)

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


async def openai_client_run(base_url: str, convs: list, concurrency: int, output_len: int):
    """The previous client: the `openai` SDK's streamed chat completions."""
    from openai import AsyncOpenAI

    from vlmserve.benchmarks.client import StreamResult

    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="none", timeout=600)
    sem = asyncio.Semaphore(concurrency)

    async def one(messages):
        async with sem:
            res = StreamResult(start=time.perf_counter())
            stream = await client.chat.completions.create(
                model="fake", messages=messages, max_tokens=output_len, temperature=0.0,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].delta.content is not None:
                    res.ttft = res.ttft if res.ttft is not None else now - res.start
                    res.stamps.append(now)
                if chunk.usage is not None:
                    res.completion_tokens = chunk.usage.completion_tokens
            res.e2e = time.perf_counter() - res.start
            return res

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(m) for m in convs))
    elapsed = time.perf_counter() - t0
    await client.close()
    return results, elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="16,64,192")
    ap.add_argument("--num-requests", type=int, default=192)
    ap.add_argument("--image-sizes", default="448,672,896")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=STEP_MS)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--openai", action="store_true", help="also the openai SDK client")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args.port, args.step_ms)

    from vlmserve.benchmarks import table
    from vlmserve.benchmarks.serve import make_messages, run_once, summarize

    base = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--port", str(args.port),
                               "--step-ms", str(args.step_ms)])

    def server_gaps() -> dict:
        with urllib.request.urlopen(base + "/v1/gaps", timeout=10) as r:
            return json.load(r)

    try:
        for _ in range(100):
            try:
                server_gaps()
                break
            except OSError:
                time.sleep(0.1)
        bench = argparse.Namespace(
            base_url=base, model="fake", seed=0, num_requests=args.num_requests,
            images_per_request=1, image_sizes=args.image_sizes, prompt_words=30,
            output_len=args.output_len, poisson=False, slo_ttft_ms=2e3, slo_tpot_ms=50.0)
        convs = make_messages(bench)
        rows = []
        for c in (int(x) for x in args.concurrency.split(",")):
            for name in (["openai", "vlmserve"] if args.openai else ["vlmserve"]):
                server_gaps()
                if name == "openai":
                    res, el = asyncio.run(openai_client_run(base, convs, c, args.output_len))
                    r = summarize(res, el, c, float("inf"), bench)
                else:
                    r = asyncio.run(run_once(bench, convs, c))
                g = server_gaps()
                rows.append([f"{name} @ {c}", f"{r['requests_per_s']:.1f}",
                             f"{r['mean_ttft_ms']:.0f}", f"{r['mean_tpot_ms']:.2f}",
                             f"{r['median_itl_ms']:.2f}", f"{r['p99_itl_ms']:.1f}",
                             f"{g['mean_ms']:.2f}", f"{g['p99_ms']:.1f}",
                             f"{r.get('client_loop_lag_p99_ms', float('nan')):.1f}"])
        print(table(["client @ concurrency", "requests/s", "TTFT mean", "TPOT mean",
                     "ITL median", "ITL p99", "server gap mean", "server gap p99",
                     "client loop lag p99"], rows))
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
