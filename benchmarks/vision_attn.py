"""The vision tower's attention on a served step's mix of images, per backend: the host's
time to launch 32 layers' worth of calls and the device's time to run them. A served step's
host launch must stay under its device time, or the device waits for the host.

    python benchmarks/vision_attn.py [--out FILE]

Backends: `torch` (SDPA per power-of-two group of equal-length images: cuDNN on Hopper),
`flash` (one varlen FlashAttention call per layer, torch's own kernel), `triton` (ours, one
launch per layer). CUDA only.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from vlmserve.layers.vision_attention import build_varlen_plan, get_vision_attention_backend
from vlmserve.layers.vision_attention import varlen_attention as grouped

MIXES = {
    "13 images 4x896+4x672+5x448": [4096] * 4 + [2304] * 4 + [1024] * 5,
    "3 images 896+672+448": [4096, 2304, 1024],
    "16 images 896": [4096] * 16,
    "1 image 448": [1024],
    # Qwen2.5-VL's window layers on the 13-image mix: 64-patch windows (112 px squares)
    "windows of the 13 images (1920 x 64)": [64] * (4 * 256 + 4 * 144 + 5 * 64),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=80)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name, lengths in MIXES.items():
        total = sum(lengths)
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        q, k, v = (torch.randn(total, args.heads, args.head_dim, device=dev,
                               dtype=torch.bfloat16) for _ in range(3))
        ref = None
        for backend in ("torch", "flash", "triton"):
            fn = get_vision_attention_backend(backend, dev, torch.bfloat16)
            host, device = [], []
            for rep in range(6):
                torch.cuda.synchronize()
                # the device sleeps while the host launches: its time is then kernels alone
                torch.cuda._sleep(500_000_000)
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                t0 = time.perf_counter()
                plan = build_varlen_plan(cu, device=dev)  # once per forward, as the tower
                cu_dev = cu.to(dev, non_blocking=True)
                for _ in range(args.layers):
                    out = (grouped(q, k, v, cu_dev, plan=plan) if fn is None
                           else fn(q, k, v, cu_dev, max(lengths)))
                t1 = time.perf_counter()
                end.record()
                torch.cuda.synchronize()
                if rep >= 2:  # the first ones build plans and compile
                    host.append(1e3 * (t1 - t0))
                    device.append(start.elapsed_time(end))
            if ref is None:
                ref = out
            err = float((out.float() - ref.float()).abs().max())
            row = {"mix": name, "backend": backend, "layers": args.layers,
                   "host_ms": round(min(host), 2), "device_ms": round(min(device), 2),
                   "max_abs_diff_vs_torch": err}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
