"""How long a burst of image requests stalls the front end's event loop (CPU, tiny model).

    python benchmarks/frontend_lag.py [--requests 48] [--workers 0,2]

For each setting of `preprocess_workers` (0: threads of the front end), an `AsyncLLM` with its
engine-core process takes a burst of W1-shaped requests (one random PNG of 448/672/896 px
as a data URL, one output token) while a ticker coroutine on the same event loop sleeps 1 ms
at a time and records how late it wakes: the delay a streamed token would see. Prints the
ticker's lag percentiles and the burst's wall time per setting.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import time

import numpy as np
from PIL import Image

from vlmserve import SamplingParams
from vlmserve.config import EngineConfig
from vlmserve.frontend.async_llm import AsyncLLM
from vlmserve.multimodal.image import RestrictedImageLoader

PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this picture."
          "<|im_end|>\n<|im_start|>assistant\n")


def data_urls(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    urls = []
    for i in range(n):
        side = (448, 672, 896)[i % 3]
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    return urls


async def burst(engine: AsyncLLM, urls: list[str]) -> dict:
    lags: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t - 0.001)

    async def one(url: str) -> None:
        prompt = {"prompt": PROMPT, "multi_modal_data": {"image": [url]}}
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        stream = await engine.add_request(prompt, params, image_loader=RestrictedImageLoader())
        async for _ in stream:
            pass

    tick = asyncio.create_task(ticker())
    start = time.perf_counter()
    await asyncio.gather(*(one(u) for u in urls))
    wall = time.perf_counter() - start
    done.set()
    await tick
    lags.sort()
    return {"wall_s": round(wall, 3), "lag_p50_ms": round(1e3 * statistics.median(lags), 2),
            "lag_p99_ms": round(1e3 * lags[int(0.99 * (len(lags) - 1))], 2),
            "lag_max_ms": round(1e3 * lags[-1], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--workers", default="0,2")
    args = ap.parse_args()
    urls = data_urls(args.requests)
    config = EngineConfig.from_kwargs(model="tiny-qwen2-vl", dtype="float32", device="cpu",
                                      max_num_batched_tokens=8192, max_model_len=8192)
    for workers in [int(w) for w in args.workers.split(",")]:
        engine = AsyncLLM(config, preprocess_workers=workers)
        try:
            asyncio.run(burst(engine, urls[:3]))  # untimed: first requests
            print(json.dumps({"preprocess_workers": workers, "requests": len(urls),
                              **asyncio.run(burst(engine, urls))}), flush=True)
        finally:
            engine.shutdown()


if __name__ == "__main__":
    main()
