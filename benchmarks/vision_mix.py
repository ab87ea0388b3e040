"""The vision tower on the mixes of image sizes a served step meets: does a batch cost what
its work says, or does a new mix pay extra (per-shape set-up) the first time? Times each of
`--mixes` random mixes (3-15 images of 448/672/896 px) twice in a row, then reports the
first and second time of each and the time of a fixed 13-image mix.

    python benchmarks/vision_mix.py [--model qwen2-vl-2b-random] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from vlmserve import LLM
from vlmserve.benchmarks.datasets import random_mm
from vlmserve.multimodal.inputs import pixel_values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2-vl-2b-random")
    ap.add_argument("--mixes", type=int, default=12)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llm = LLM(args.model, kernel_warmup=False)
    engine = llm.engine
    runner = engine.executor.runner
    rng = random.Random(0)
    out = open(args.out, "a") if args.out else sys.stdout  # noqa: SIM115

    def images(n: int, seed: int):
        sizes = [rng.choice([448, 672, 896]) for _ in range(n)]
        reqs = [random_mm(llm.get_tokenizer(), num_requests=1, image_sizes=[s],
                          images_per_request=1, prompt_len=4, output_len=1, seed=seed * 100 + i)
                for i, s in enumerate(sizes)]
        imgs = [engine.input_processor.process(r[0].prompt).images[0] for r in reqs]
        return sizes, imgs

    def sync() -> None:
        if runner.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(imgs) -> float:
        sync()
        t = time.perf_counter()
        with torch.inference_mode():
            px = pixel_values(imgs, [img.pixels.to(runner.device) for img in imgs], runner.dtype)
            runner.model.encode_images(px, [img.encoder_meta for img in imgs])
        sync()
        return (time.perf_counter() - t) * 1e3

    fixed_sizes, fixed = images(13, 999)
    for i in range(args.mixes):
        sizes, imgs = images(rng.randint(3, 15), i)
        first, second = timed(imgs), timed(imgs)
        print(json.dumps({"mix": i, "images": len(sizes), "sizes": sorted(sizes),
                          "first_ms": round(first, 1), "second_ms": round(second, 1)}),
              file=out, flush=True)
    print(json.dumps({"fixed13": sorted(fixed_sizes),
                      "ms": [round(timed(fixed), 1) for _ in range(4)]}), file=out, flush=True)


if __name__ == "__main__":
    main()
