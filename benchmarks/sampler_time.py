"""Host (and on CUDA, device) milliseconds of one step's sampling, and the torch ops it
launches, for a batch of requests with given sampling parameters.

    python benchmarks/sampler_time.py [--device cuda] [--batch 192] [--vocab 151936]

Mixes: greedy (temperature 0), default (OpenAI's: temperature 1), nucleus (temperature
0.7, top_p 0.9), topk (temperature 0.7, top_k 50), seeded (nucleus, every request with a
seed). To time another tree's sampler, put it first on PYTHONPATH (`git archive REV vlmserve
| tar -x -C /tmp/old`).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vlmserve.layers.sampler import sample
from vlmserve.sampling_params import SamplingParams

MIXES = {
    "greedy": dict(temperature=0.0),
    "default": dict(temperature=1.0),
    "nucleus": dict(temperature=0.7, top_p=0.9),
    "topk": dict(temperature=0.7, top_k=50),
    "seeded": dict(temperature=0.7, top_p=0.9, seed=1),
}


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=192)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    logits = torch.randn(args.batch, args.vocab, device=device) * 3
    for name, kw in MIXES.items():
        params = [SamplingParams(**{**kw, "seed": kw["seed"] + i} if "seed" in kw else kw)
                  for i in range(args.batch)]
        gens = [torch.Generator(device=device).manual_seed(p.seed) if p.seed is not None
                else None for p in params]
        sample(logits, params, gens)  # warm-up
        with _CountOps() as ops:
            sample(logits, params, gens)
        host, dev_ms = [], []
        for _ in range(args.repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            sample(logits, params, gens)
            host.append(1e3 * (time.perf_counter() - t0))
            if device.type == "cuda":
                end.record()
                end.synchronize()
                dev_ms.append(start.elapsed_time(end))
        print(json.dumps({"mix": name, "batch": args.batch, "vocab": args.vocab,
                          "torch_ops": ops.n, "host_ms_median": round(sorted(host)[len(host) // 2], 3),
                          "device_ms_median": round(sorted(dev_ms)[len(dev_ms) // 2], 3)
                          if dev_ms else None}))


if __name__ == "__main__":
    main()
