"""Where a `MultimodalEncoder` forward's time goes on one device (issue 22's EPD gap): host
launch vs device time of the tower, the export, for batches of W1-shaped images, alone and
with a second Python thread busy (as the encoder server's event loop is while it reads
requests: GIL contention).

    python benchmarks/encoder_forward.py --model qwen2-vl-2b-random [--batches 1,4,13]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import numpy as np
import torch
from PIL import Image

from vlmserve.encoder.encoder import MultimodalEncoder
from vlmserve.worker.encoder_runner import encoder_order

SIZES = (448, 672, 896)


def _requests(enc: MultimodalEncoder, n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    tok = enc.model_processor.image_token_id
    return [enc.process({"prompt_token_ids": [tok, 0], "multi_modal_data": {"image": [
        Image.fromarray(rng.integers(0, 256, (s, s, 3), dtype=np.uint8))]}})
        for s in (SIZES[i % 3] for i in range(n))]


def _time(enc: MultimodalEncoder, batch: list, reps: int) -> dict:
    dev = enc.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    launch, total, device, export = [], [], [], []
    for _ in range(reps):
        unique = encoder_order([img for p in batch for img in p.images])
        sync()
        t0 = time.perf_counter()
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        with torch.inference_mode():
            rows = enc._run_tower(unique)
        t1 = time.perf_counter()
        if dev.type == "cuda":
            b.record()
        sync()
        t2 = time.perf_counter()
        launch.append(t1 - t0)
        total.append(t2 - t0)
        if dev.type == "cuda":
            device.append(a.elapsed_time(b) / 1e3)
        t3 = time.perf_counter()
        handles = [enc.ledger.export(r, "auto") for r in rows.values()]
        export.append(time.perf_counter() - t3)
        for h in handles:
            h.open(dev)
    ms = lambda xs: round(statistics.median(xs) * 1e3, 2) if xs else None  # noqa: E731
    n = len(batch)
    return {"images": n, "launch_ms": ms(launch), "forward_ms": ms(total),
            "device_ms": ms(device), "export_ms": ms(export),
            "forward_ms_per_image": round(ms(total) / n, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2-vl-2b-random")
    ap.add_argument("--batches", default="1,4,13")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--switch-interval", type=float, default=None)
    args = ap.parse_args()
    if args.switch_interval:
        import sys
        sys.setswitchinterval(args.switch_interval)
    enc = MultimodalEncoder(args.model)
    results = []
    for busy in (False, True):
        stop = threading.Event()
        if busy:
            def spin(stop: threading.Event = stop) -> None:
                while not stop.is_set():
                    sum(range(2000))
            threading.Thread(target=spin, daemon=True).start()
        for i, n in enumerate(int(b) for b in args.batches.split(",")):
            batch = _requests(enc, n, seed=100 * i + busy)
            _time(enc, batch, 2)  # shapes seen once (cuDNN graphs, Triton variants)
            r = {"busy_thread": busy, **_time(enc, _requests(enc, n, seed=7 + i), args.reps)}
            print(json.dumps(r), flush=True)
            results.append(r)
        stop.set()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    enc.shutdown()


if __name__ == "__main__":
    main()
