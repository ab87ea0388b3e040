"""The encoder as a service, producer and consumer in two processes on one device: memory
over many requests (the leak check), and the export + open + copy time per image.

    python -m vlmserve.benchmarks.encoder_ipc --model qwen2-vl-2b-random --requests 1000
    python -m vlmserve.benchmarks.encoder_ipc --model qwen2-vl-2b-random --requests 1000 \\
        --unopened-per-request 1      # negative control: a handle per request nobody opens

A `MultimodalEncoder` here encodes one request at a time, cycling three images of different
sizes (by default 448x448, 672x672 and 1120x896 px: 256, 576 and 1,280 tokens), and sends
the handles (CUDA IPC on a GPU, shared memory on the CPU) to a consumer process that copies
the rows into a buffer of its own and releases them, as the engine core does. Every
`--sample-every` requests both processes report their device memory (allocated and reserved
by PyTorch's allocator), the producer its ledger (live handles and bytes), and the device its
used memory. With `--unopened-per-request N` the producer also exports N handles per request
that nobody opens (what a tensor-parallel follower did before the export rule): their memory
stays until the lease (`--lease-s`, long by default) runs out.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import torch

from vlmserve.benchmarks import engine_options, parse_args
from vlmserve.flags import add_engine_options

SIZES = ((448, 448), (672, 672), (1120, 896))


def _consumer(conn, device: str) -> None:
    """Open each handle into a buffer of this process, release it, answer the timings."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=dev)  # the context, before anything is measured
    while (msg := conn.recv()) is not None:
        if msg == "memory":
            conn.send(_memory(dev))
            continue
        times = []
        for handle in msg:
            t0 = time.perf_counter()
            rows = handle.open(dev)  # as the engine core does: waits for the copy, releases
            times.append(time.perf_counter() - t0)
            del rows
        conn.send(times)


def _memory(dev: torch.device) -> dict:
    if dev.type != "cuda":
        return {}
    return {"allocated": torch.cuda.memory_allocated(dev),
            "reserved": torch.cuda.memory_reserved(dev)}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(args: argparse.Namespace | None = None) -> None:
    args = parse_args(args, add_args, __doc__)
    from PIL import Image

    from vlmserve.encoder.encoder import MultimodalEncoder

    enc = MultimodalEncoder(**engine_options(args), lease_s=args.lease_s)
    dev = enc.device
    rng = torch.Generator().manual_seed(0)
    images = [Image.fromarray(torch.randint(0, 256, (h, w, 3), dtype=torch.uint8,
                                            generator=rng).numpy()) for w, h in SIZES]
    pads = "<|vision_start|><|image_pad|><|vision_end|>"
    prompts = [{"prompt": f"<|im_start|>user\n{pads}Describe.<|im_end|>\n",
                "multi_modal_data": {"image": [img]}} for img in images]
    processed = [enc.process(p) for p in prompts]  # preprocessing is not what is measured
    lengths = [p.images[0].length for p in processed]
    current = [0]  # the image being encoded
    export_times: list[list[float]] = [[] for _ in processed]
    real_export = enc.ledger.export

    def timed_export(t: torch.Tensor, transport: str = "auto"):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # the tower's work is not the export's
        t0 = time.perf_counter()
        h = real_export(t, transport)
        export_times[current[0]].append(time.perf_counter() - t0)
        return h

    enc.ledger.export = timed_export  # type: ignore[method-assign]
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(theirs, str(dev)), daemon=True)
    proc.start()
    open_times: list[list[float]] = [[] for _ in processed]
    samples = []

    def sample(i: int) -> None:
        deadline = time.monotonic() + 10  # the releases of this request reach the ledger
        while (enc.ledger.stats().live_handles > args.unopened_per_request * i
               and time.monotonic() < deadline):
            time.sleep(0.005)
        ours.send("memory")
        consumer = ours.recv()
        led = enc.ledger.stats()
        free, total = torch.cuda.mem_get_info(dev) if dev.type == "cuda" else (0, 0)
        samples.append({"requests": i, "producer": _memory(dev), "consumer": consumer,
                        "device_used": total - free, "live_handles": led.live_handles,
                        "live_bytes": led.live_bytes})

    try:
        for i in range(args.warmup):  # allocator and context settle
            current[0] = i % 3
            out = enc.encode([processed[i % 3]])
            ours.send([img.handle for o in out for img in o.images])
            ours.recv()
        for v in export_times:
            v.clear()
        sample(0)
        t_start = time.perf_counter()
        for i in range(1, args.requests + 1):
            current[0] = (i - 1) % 3
            p = processed[current[0]]
            out = enc.encode([p])
            for _ in range(args.unopened_per_request):  # exported, never opened
                enc.encode([p], export=True)
            ours.send([img.handle for o in out for img in o.images])
            open_times[current[0]] += ours.recv()
            if i % args.sample_every == 0:
                sample(i)
        elapsed = time.perf_counter() - t_start
        ours.send(None)
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
        enc.shutdown()

    first, last = samples[0], samples[-1]
    per_k = 1000 / args.requests

    def growth(side: str, key: str) -> float | None:
        a, b = first[side].get(key), last[side].get(key)
        return None if a is None else (b - a) * per_k / 2**20

    result = {
        "model": engine_options(args)["model"], "device": str(dev), "requests": args.requests,
        "unopened_per_request": args.unopened_per_request, "elapsed_s": elapsed,
        "growth_mib_per_1000": {
            "producer_allocated": growth("producer", "allocated"),
            "producer_reserved": growth("producer", "reserved"),
            "consumer_allocated": growth("consumer", "allocated"),
            "consumer_reserved": growth("consumer", "reserved"),
            "device_used": (last["device_used"] - first["device_used"]) * per_k / 2**20,
        },
        "live_handles_at_end": last["live_handles"],
        "timing_ms": {f"{w}x{h}px {n} rows": {
            "export_p50": 1e3 * statistics.median(ex),
            "export_p99": 1e3 * _pct(ex, 0.99),
            "open_copy_p50": 1e3 * statistics.median(op),
            "open_copy_p99": 1e3 * _pct(op, 0.99),
            "sum_p50": 1e3 * (statistics.median(ex) + statistics.median(op)),
        } for (w, h), n, ex, op in zip(SIZES, lengths, export_times, open_times, strict=True)},
        "samples": samples,
    }
    print(f"{args.requests} requests in {elapsed:.1f} s on {dev}, "
          f"{args.unopened_per_request} unopened handle(s) per request")
    print(f"{'requests':>8} {'producer alloc MiB':>19} {'consumer alloc MiB':>19} "
          f"{'device used MiB':>16} {'live handles':>13}")
    for s in samples:
        print(f"{s['requests']:>8} {s['producer'].get('allocated', 0) / 2**20:>19.2f} "
              f"{s['consumer'].get('allocated', 0) / 2**20:>19.2f} "
              f"{s['device_used'] / 2**20:>16.1f} {s['live_handles']:>13}")
    print("growth per 1,000 requests (MiB): " + ", ".join(
        f"{k} {v:.3f}" for k, v in result["growth_mib_per_1000"].items() if v is not None))
    print(f"{'image':>22} {'export p50/p99 ms':>18} {'open+copy p50/p99 ms':>21} {'sum p50':>8}")
    for n, t in result["timing_ms"].items():
        print(f"{n:>22} {t['export_p50']:>8.3f}/{t['export_p99']:<9.3f} "
              f"{t['open_copy_p50']:>10.3f}/{t['open_copy_p99']:<10.3f} {t['sum_p50']:>8.3f}")
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--requests", type=int, default=1000,
                    help="requests after the warm-up (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=30,
                    help="requests before the first sample (default: %(default)s)")
    ap.add_argument("--sample-every", type=int, default=50,
                    help="memory sampled every N requests (default: %(default)s)")
    ap.add_argument("--unopened-per-request", type=int, default=0,
                    help="extra handles exported per request that nobody opens: the negative "
                    "control (default: %(default)s)")
    ap.add_argument("--lease-s", type=float, default=3600.0,
                    help="handle lease of the producer (default: %(default)s)")
    ap.add_argument("--out", default=None, help="write the result and samples as JSON here")
    add_engine_options(ap)  # the encoder takes the engine's options (those of its tower)


if __name__ == "__main__":
    main()
