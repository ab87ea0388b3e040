"""Put this folder on PYTHONPATH to log every full (generation 2) garbage-collector pass of
every Python process started with it: at exit, /tmp/gc_probe/gen2_PID.txt holds the
process's command line and each pass as `duration_ms@seconds_since_start`."""

import atexit
import gc
import os
import sys
import time

_T0 = time.perf_counter()
_start = [0.0]
_passes: list[tuple[float, float]] = []


def _callback(phase: str, info: dict) -> None:
    if phase == "start":
        _start[0] = time.perf_counter()
    elif info["generation"] == 2:
        now = time.perf_counter()
        _passes.append(((now - _start[0]) * 1e3, now - _T0))


def _dump() -> None:
    if _passes:
        os.makedirs("/tmp/gc_probe", exist_ok=True)
        with open(f"/tmp/gc_probe/gen2_{os.getpid()}.txt", "w") as f:
            f.write(" ".join(sys.argv)[:100] + "\n")
            f.write(" ".join(f"{ms:.1f}ms@{t:.0f}s" for ms, t in _passes) + "\n")


gc.callbacks.append(_callback)
atexit.register(_dump)
