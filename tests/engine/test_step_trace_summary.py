"""`benchmarks/step_trace.py` on a trace the H200 wrote (a served run at concurrency 64 and
192, 2026-12-05c in docs/benchmarks.md): bursts, step times, the host / device split. The
fixture keeps the whole burst at concurrency 64 and 21 steps of the bursts either side (the
warm-up's last, concurrency 192's first), times rounded to a microsecond."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("step_trace", ROOT / "benchmarks/step_trace.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_summary_of_a_served_trace() -> None:
    mod = _module()
    path = ROOT / "tests/fixtures/step_trace_c64.jsonl"
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    bursts = mod.bursts(steps, 0.5)
    assert [len(b) for b in bursts] == [21, 409, 21]  # warm-up, concurrency 64, 192
    c64 = mod.summarize(bursts[1], 10.0)
    assert c64["steps"] == 409 and c64["image_steps"] == 24
    # every image step's host launch was at least 90% of its device time
    assert c64["image_steps_host_bound"] == 24
    assert 5.0 < c64["seconds"] < 5.6 and c64["alloc_retries"] == 0
    long = c64["long_steps_mean"]
    assert long["vision_ms"] < long["device_ms"] and long["vision_launch_ms"] < long["launch_ms"]
    # the summed device time of the steps covers the burst: the device was never idle long
    assert 0.9 * 1e3 * c64["seconds"] < c64["device_ms_sum"] < 1.05 * 1e3 * c64["seconds"]
    # by kind: decodes alone (CUDA graphs) and steps with a prompt chunk (eager)
    dec, pre = c64["decode_only_steps"], c64["prompt_steps"]
    assert dec["n"] + pre["n"] <= c64["steps"] - 1 and pre["n"] >= c64["image_steps"]
    assert dec["device_ms"] < 5.0 < pre["device_ms"] and dec["decodes"] > 0
