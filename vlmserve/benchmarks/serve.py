"""Online benchmark against a running OpenAI-compatible server (`vlmserve serve`).

Sends `random-mm` chat requests (images as data URLs) at a Poisson or fixed rate under a
concurrency limit, streams every answer, and reports TTFT, time per output token (TPOT),
inter-token latency (ITL) as mean/median/p99, throughput and goodput; JSON and PNG plots.

    vlmserve bench serve --base-url http://127.0.0.1:8000 --num-requests 200 \\
        --request-rate 8 --concurrency 1,8,32 --out-dir bench_out
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from vlmserve.benchmarks import parse_args
from vlmserve.benchmarks.client import (
    LoopLag,
    StreamResult,
    chat_body,
    first_model,
    image_data_url,
    open_session,
    stream_chat,
    video_data_url,
)


def make_messages(args) -> list[list[dict]]:
    rng = np.random.default_rng(args.seed)
    words = ["image", "describe", "color", "shape", "left", "right", "count", "the", "scene"]
    convs = []
    for _ in range(args.num_requests):
        parts = []
        for _ in range(args.images_per_request):
            side = int(rng.choice([int(s) for s in args.image_sizes.split(",")]))
            parts.append({"type": "image_url", "image_url": {"url": image_data_url(side, rng)}})
        for _ in range(args.videos_per_request):
            url = video_data_url(args.video_frames, args.video_size, rng)
            parts.append({"type": "video_url", "video_url": {"url": url}})
        text = " ".join(rng.choice(words, args.prompt_words))
        parts.append({"type": "text", "text": text})
        convs.append([{"role": "user", "content": parts}])
    return convs


_SERVER_HISTOGRAMS = {"ttft": "vlmserve_time_to_first_token_seconds",
                      "itl": "vlmserve_inter_token_latency_seconds",
                      "step": "vlmserve_engine_step_seconds",
                      # arrival to hand-over to the core: HTTP, image decoding and resizing,
                      # template, tokenization (the front end's part of the TTFT)
                      "frontend": "vlmserve_request_frontend_seconds"}


def _server_histograms(base_url: str) -> dict[str, dict[str, float]] | None:
    """The server's own TTFT, inter-token, engine-step and front-end histograms (its front
    ends' clocks) from its Prometheus endpoint: per histogram its sum, count and cumulative
    bucket counts by upper bound; None when it has none (another server)."""
    import urllib.request

    try:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except (ImportError, OSError, ValueError):
        return None
    wanted = {m: k for k, m in _SERVER_HISTOGRAMS.items()}
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        key = wanted.get(family.name)
        if key is None:
            continue
        h = out.setdefault(key, {})
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = sample.labels["le"]
                h[le] = h.get(le, 0.0) + sample.value  # summed over front ends
            elif sample.name.endswith(("_sum", "_count")):
                field = sample.name.rsplit("_", 1)[1]
                h[field] = h.get(field, 0.0) + sample.value
    return out if len(out) == len(_SERVER_HISTOGRAMS) else None


def _server_figures(before: dict, after: dict) -> dict[str, float | None]:
    """What the server's histograms say of one run: the mean of each and the upper bound of
    the bucket its 99th percentile falls in (`..._p99_le_ms`: "at most this")."""
    out: dict[str, float | None] = {}
    for key in _SERVER_HISTOGRAMS:
        b, a = before[key], after[key]
        n = a.get("count", 0) - b.get("count", 0)
        out[f"server_mean_{key}_ms"] = 1e3 * (a["sum"] - b["sum"]) / n if n else None
        bounds = sorted((float(le), a[le] - b.get(le, 0.0)) for le in a
                        if le not in ("sum", "count"))
        out[f"server_p99_{key}_le_ms"] = next(
            (1e3 * le for le, c in bounds if n and c >= 0.99 * n), None)
    return out


async def run_once(args, convs, concurrency: int, rate: float = float("inf")) -> dict:
    async with open_session(args.base_url) as session:
        model = args.model or await first_model(session)
        bodies = [chat_body(model, messages, args.output_len, args.extra_body)
                  for messages in convs]
        sem = asyncio.Semaphore(concurrency)
        rng = np.random.default_rng(args.seed + 1)
        bar = tqdm(total=len(convs), desc=f"concurrency {concurrency}")

        async def limited(body):
            async with sem:
                res = await stream_chat(session, body)
                bar.update(1)
                return res

        before = await asyncio.to_thread(_server_histograms, args.base_url)
        tasks = []
        async with LoopLag() as lag:
            t0 = time.perf_counter()
            for body in bodies:
                tasks.append(asyncio.create_task(limited(body)))
                if rate != float("inf"):
                    gap = rng.exponential(1 / rate) if args.poisson else 1 / rate
                    await asyncio.sleep(gap)
            results = await asyncio.gather(*tasks)
            elapsed = time.perf_counter() - t0
        bar.close()
    out = summarize(results, elapsed, concurrency, rate, args)
    out.update(lag.summary())  # the client's own lag: near 0 when it kept up
    after = await asyncio.to_thread(_server_histograms, args.base_url)
    if before and after:  # the engine's own pacing: client-side gaps above it are delivery
        out.update(_server_figures(before, after))
    return out


def _stats(xs: list[float], name: str) -> dict:
    xs = sorted(xs) or [0.0]
    return {f"mean_{name}_ms": 1e3 * statistics.fmean(xs),
            f"median_{name}_ms": 1e3 * statistics.median(xs),
            f"p99_{name}_ms": 1e3 * xs[min(len(xs) - 1, int(0.99 * len(xs)))]}


def summarize(results: list[StreamResult], elapsed: float, concurrency: int, rate: float,
              args) -> dict:
    ok = [r for r in results if r.error is None and r.ttft is not None]
    ttfts = [r.ttft for r in ok]
    tpots = [(r.e2e - r.ttft) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    itls = [x for r in ok for x in r.itls]
    good = [r for r in ok if r.ttft * 1e3 <= args.slo_ttft_ms and (
        r.completion_tokens <= 1
        or (r.e2e - r.ttft) / (r.completion_tokens - 1) * 1e3 <= args.slo_tpot_ms)]
    out = {
        "concurrency": concurrency, "request_rate": rate,
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": elapsed,
        "errors": sorted({r.error for r in results if r.error})[:3],
        "requests_per_s": len(ok) / elapsed,
        "output_tokens_per_s": sum(r.completion_tokens for r in ok) / elapsed,
        "goodput_requests_per_s": len(good) / elapsed,
        **_stats(ttfts, "ttft"), **_stats(tpots, "tpot"), **_stats(itls, "itl"),
        "ttfts_ms": [1e3 * x for x in ttfts], "tpots_ms": [1e3 * x for x in tpots],
        "itls_ms": [1e3 * x for x in itls],
    }
    return out


_COLUMNS = (("requests/s", "requests_per_s", "{:.2f}"), ("output tok/s", "output_tokens_per_s",
            "{:.0f}"), ("goodput/s", "goodput_requests_per_s", "{:.2f}"),
            ("TTFT mean", "mean_ttft_ms", "{:.0f}"), ("TTFT p99", "p99_ttft_ms", "{:.0f}"),
            ("TPOT mean", "mean_tpot_ms", "{:.2f}"), ("TPOT p99", "p99_tpot_ms", "{:.2f}"),
            ("ITL median", "median_itl_ms", "{:.2f}"), ("ITL p99", "p99_itl_ms", "{:.1f}"),
            ("client lag p99", "client_loop_lag_p99_ms", "{:.1f}"))


def summary_table(runs: list[dict]) -> str:
    """The runs as a table to read (latencies in ms), as `vllm bench serve` prints them."""
    head = ["run", "done", "failed", *(c for c, _, _ in _COLUMNS)]
    rows = [[f"{r['request_rate']:g}/s @ {r['concurrency']}", str(r["completed"]),
             str(r["failed"]), *(f.format(r[k]) for _, k, f in _COLUMNS)] for r in runs]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = "  ".join("-" * w for w in widths)
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), line, *(fmt.format(*row) for row in rows)])


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--base-url", default="http://127.0.0.1:8000",
                    help="the server (any OpenAI-compatible one)")
    ap.add_argument("--model", default=None, help="served model name (default: the first)")
    ap.add_argument("--num-requests", type=int, default=100, help="timed requests per run")
    ap.add_argument("--request-rate", type=float, default=float("inf"),
                    help="requests per second (inf: all at once)")
    ap.add_argument("--poisson", action=argparse.BooleanOptionalAction, default=True,
                    help="exponential gaps (Poisson arrivals) instead of fixed ones")
    ap.add_argument("--concurrency", default="64", help="limit(s), comma-separated: a sweep")
    ap.add_argument("--runs", default=None, metavar="RATE@CONCURRENCY,...",
                    help="explicit runs instead of the concurrency sweep, e.g. "
                    "'inf@16,inf@64,8@1000' (rate in requests/s, inf: all at once)")
    ap.add_argument("--image-sizes", default="448,672,896",
                    help="square image sides in pixels, drawn at random per image")
    ap.add_argument("--images-per-request", type=int, default=1, help="images in each request")
    ap.add_argument("--videos-per-request", type=int, default=0,
                    help="videos in each request (video_url parts: random MP4 files, 2 fps)")
    ap.add_argument("--video-frames", type=int, default=16, help="frames of each video")
    ap.add_argument("--video-size", type=int, default=448, help="each video's side in pixels")
    ap.add_argument("--prompt-words", type=int, default=30, help="random words of text each")
    ap.add_argument("--output-len", type=int, default=128,
                    help="output tokens each (ignore_eos)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the random requests (run i > 0 draws with seed + 1 + i)")
    ap.add_argument("--reuse-requests", action="store_true",
                    help="every run replays the first run's requests (then a server's prefix "
                    "and image caches hold them from the second run on); by default each "
                    "run draws requests of its own")
    ap.add_argument("--warmup-requests", type=int, default=16,
                    help="untimed requests (other images) sent before the timed runs")
    ap.add_argument("--extra-body", type=json.loads, default=None, metavar="JSON",
                    help="fields added to every request (e.g. '{\"response_format\": "
                    "{\"type\": \"json_object\"}}' for structured outputs' cost)")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput: TTFT bound")
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0, help="goodput: TPOT bound")
    ap.add_argument("--out-dir", default=None, help="JSON results and PNG plots here")


def run_messages(args, run: int) -> list[list[dict]]:
    """The requests of run `run` (0-based): the first run's with `--reuse-requests`, else
    each run's own (seed + 1 + run after the first; seed + 1 is the warm-up's), the same for
    every server benchmarked with these arguments."""
    if run == 0 or args.reuse_requests:
        return make_messages(args)
    return make_messages(argparse.Namespace(**{**vars(args), "seed": args.seed + 1 + run}))


def main(args: argparse.Namespace | None = None) -> list[dict]:
    args = parse_args(args, add_args, __doc__)
    if args.runs:
        plan = [(float(r), int(c)) for r, c in (x.split("@") for x in args.runs.split(","))]
    else:
        plan = [(args.request_rate, int(c)) for c in args.concurrency.split(",")]
    levels = [c for _, c in plan]
    if args.warmup_requests:  # untimed: the server's first requests build kernels and plans
        warm = make_messages(argparse.Namespace(**{**vars(args), "seed": args.seed + 1,
                                                   "num_requests": args.warmup_requests}))
        asyncio.run(run_once(args, warm, max(levels)))
    runs = [asyncio.run(run_once(args, run_messages(args, i), c, rate))
            for i, (rate, c) in enumerate(plan)]
    print(summary_table(runs))
    for r in runs:  # one machine-readable line per run (scripts grep for them)
        print(json.dumps({k: v for k, v in r.items() if not k.endswith("s_ms")}))
    if args.out_dir:
        from vlmserve.benchmarks.plots import latency_distributions, throughput_vs_concurrency

        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "serve.json").write_text(json.dumps({"args": vars(args), "runs": runs}))
        latency_distributions(runs, out / "latency.png")
        throughput_vs_concurrency(runs, out / "throughput_vs_concurrency.png")
    return runs


if __name__ == "__main__":
    main()
