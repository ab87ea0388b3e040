"""Host time of admission preprocessing of a prompt with two images (the same data URL
twice), without and with the front end's cache of processed images (the image seen before).

    python benchmarks/image_cache_time.py [MODEL]
"""

import base64
import io
import sys
import time

import numpy as np
from PIL import Image

from vlmserve.inputs.processor import InputProcessor
from vlmserve.models.metadata import load_model_processor

PAD = "<|vision_start|><|image_pad|><|vision_end|>"


def main() -> None:
    _, _, mp = load_model_processor(sys.argv[1] if len(sys.argv) > 1 else "tiny-qwen2-vl")
    rng = np.random.default_rng(0)
    for fmt in ("PNG", "JPEG"):
        for size in (448, 896, 1344):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(
                buf, format=fmt)
            url = (f"data:image/{fmt.lower()};base64,"
                   + base64.b64encode(buf.getvalue()).decode())
            prompt = {"prompt": f"user {PAD}{PAD} hi", "multi_modal_data": {"image": [url, url]}}
            cached = InputProcessor(mp, 10**6, image_cache_bytes=256 << 20)
            plain = InputProcessor(mp, 10**6)
            cached.process(prompt)

            print(f"{fmt} 2 x {size}px: uncached {_median_ms(plain, prompt):.1f} ms, "
                  f"cached {_median_ms(cached, prompt):.1f} ms")


def _median_ms(proc: InputProcessor, prompt: dict, n: int = 5) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        proc.process(prompt)
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2] * 1e3


if __name__ == "__main__":
    main()
