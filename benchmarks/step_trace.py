"""Summarize an engine-core step trace (``VLMSERVE_STEP_TRACE=path`` on the server): steps
split into bursts at idle gaps, each step's time taken as the gap between its read-back and
the previous one (the device's time for it when the loop keeps the device busy), what the
long steps carried, and (newer traces) the host's launch time and the device's time, the
vision tower's share of both, the core thread's CPU time in its launches, and the caching
allocator's retries.

    python benchmarks/step_trace.py trace.jsonl [--long-ms 10]
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def bursts(steps: list[dict], idle_s: float) -> list[list[dict]]:
    out: list[list[dict]] = [[]]
    for prev, cur in zip([None, *steps], steps):
        if prev is not None and cur["launch"] - prev["done"] > idle_s:
            out.append([])
        out[-1].append(cur)
    return [b for b in out if len(b) > 20]


def summarize(burst: list[dict], long_ms: float) -> dict:
    done = np.array([s["done"] for s in burst])
    dt = np.diff(done) * 1e3  # step i+1's time
    rest = burst[1:]
    keys = ["decodes", "prompt_tokens", "images", "image_rows", "launch_ms", "launch_cpu_ms",
            "device_ms", "vision_launch_ms", "vision_launch_cpu_ms", "vision_ms"]
    col = {k: np.array([s.get(k) or 0.0 for s in rest], dtype=float) for k in keys}
    with_dec = col["decodes"] > 0
    long = dt > long_ms

    def mean(k, m):
        return float(col[k][m].mean()) if m.any() else 0.0
    return {
        "seconds": float(done[-1] - burst[0]["launch"]), "steps": len(burst),
        "step_ms_p50_p90_p99_max": np.percentile(dt, [50, 90, 99, 100]).round(1).tolist(),
        "steps_with_decodes": int(with_dec.sum()),
        "of_those_over_long_ms": int((long & with_dec).sum()),
        "long_steps_mean": {k: round(mean(k, long & with_dec), 1) for k in col},
        "short_steps_mean": {k: round(mean(k, ~long & with_dec), 1) for k in col},
        # steps of decodes alone (CUDA graphs) and steps with a prompt chunk (eager): how
        # many, and their mean host launch and device milliseconds
        "decode_only_steps": _kind(col, with_dec & (col["prompt_tokens"] == 0)),
        "prompt_steps": _kind(col, col["prompt_tokens"] > 0),
        "images_per_step_max": int(col["images"].max()),
        "ms_in_steps_with_images": round(float(dt[col["images"] > 0].sum()), 1),
        "ms_in_steps_without": round(float(dt[col["images"] == 0].sum()), 1),
        # the host's time launching steps, and the device's from each step's first event to
        # its last (CUDA; host stalls inside a launch included)
        "launch_ms_sum": round(float(col["launch_ms"].sum()), 1),
        # the core thread's CPU time in those launches (newer traces): the rest it waited
        # (for the device, or for a CPU that other processes held)
        "launch_cpu_ms_sum": round(float(col["launch_cpu_ms"].sum()), 1),
        "device_ms_sum": round(float(col["device_ms"].sum()), 1),
        # of those, the vision tower's (host launch; device from the step's start to its end)
        "vision_launch_ms_sum": round(float(col["vision_launch_ms"].sum()), 1),
        "vision_launch_cpu_ms_sum": round(float(col["vision_launch_cpu_ms"].sum()), 1),
        "vision_ms_sum": round(float(col["vision_ms"].sum()), 1),
        # steps with images whose host launch took at least 90% of their device time: the
        # device waited for the host (or the host blocked on a full launch queue)
        "image_steps_host_bound": int(((col["images"] > 0) & (col["device_ms"] > 0)
                                       & (col["launch_ms"] >= 0.9 * col["device_ms"])).sum()),
        "image_steps": int((col["images"] > 0).sum()),
        # allocations the caching allocator retried after emptying its cache, in this burst
        "alloc_retries": (burst[-1].get("alloc_retries") or 0)
        - (burst[0].get("alloc_retries") or 0),
    }


def _kind(col: dict, m: np.ndarray) -> dict:
    return {"n": int(m.sum()), **{k: round(float(col[k][m].mean()), 2) if m.any() else 0.0
                                  for k in ("launch_ms", "device_ms", "decodes")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--long-ms", type=float, default=10.0)
    ap.add_argument("--idle-s", type=float, default=0.5)
    args = ap.parse_args()
    with open(args.trace) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    for i, b in enumerate(bursts(steps, args.idle_s)):
        print(f"burst {i}:", json.dumps(summarize(b, args.long_ms)))


if __name__ == "__main__":
    main()
