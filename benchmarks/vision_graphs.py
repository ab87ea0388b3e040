"""A vision step's host launch time and device time, eager and replayed from a CUDA graph,
on a full-size tower (random bf16 weights) for served mixes of images. The host's launching
must stay under the device's work, or the device waits for the host.

    python benchmarks/vision_graphs.py [--preset qwen2-vl-2b-random] [--out FILE]

The device sleeps while the host launches, so the device time is the kernels' alone. CUDA
only.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from vlmserve.layers.vision_attention import get_vision_attention_backend
from vlmserve.models.builtin import build_config
from vlmserve.models.registry import resolve_model_class
from vlmserve.worker.vision_graphs import VisionGraphs

# patch grids of 448, 672 and 896 px images (14 px patches)
MIXES = {
    "1 image 448": [[1, 32, 32]],
    "2 images 448+672": [[1, 32, 32], [1, 48, 48]],
    "1 image 896": [[1, 64, 64]],
    "3 images 448+672+896": [[1, 32, 32], [1, 48, 48], [1, 64, 64]],
}


def _time(fn, reps: int = 5) -> tuple[float, float]:
    """(host ms, device ms): the best of ``reps`` after two untimed calls."""
    host, device = [], []
    for rep in range(reps + 2):
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)  # the device is busy while the host launches
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        if rep >= 2:
            host.append(1e3 * (t1 - t0))
            device.append(start.elapsed_time(end))
    return min(host), min(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2-vl-2b-random")
    ap.add_argument("--backend", default="flash", choices=("flash", "triton"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = build_config(args.preset)
    torch.manual_seed(0)
    with torch.device("cuda"):
        tower = resolve_model_class(cfg).vision_cls(cfg.vision_config).to(torch.bfloat16)
    for p in tower.parameters():
        torch.nn.init.normal_(p, std=0.02)
    tower.eval().set_attention_backend(
        get_vision_attention_backend(args.backend, torch.device("cuda"), torch.bfloat16))
    graphs = VisionGraphs(tower, max_rows=16384)
    rows = []
    with torch.inference_mode():
        for name, grids in MIXES.items():
            grid = torch.tensor(grids)
            pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, device="cuda")
            row = {"mix": name, "rows": pixels.shape[0], "preset": args.preset,
                   "backend": args.backend}
            for mode, g in (("eager", None), ("graph", graphs)):
                tower.graphs = g
                host, device = _time(lambda: tower(pixels, grid))  # noqa: B023
                row[f"{mode}_host_ms"], row[f"{mode}_device_ms"] = round(host, 3), round(
                    device, 3)
            tower.graphs = None
            row["graph_host_share"] = round(row["graph_host_ms"] / row["graph_device_ms"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
