"""Host time of admission preprocessing per image size (CPU only): ours (decode to an array,
hash, resize only when the size changes; the rest runs on the device at encode time) against
the HF image processor alone (resize, rescale, normalize, patchify on the host) and the
transformers backend's whole admission of the image (`--model-impl transformers`: the HF
processor on prompt and image, then the image's tensors packed in the model's dtype).

    python benchmarks/preprocess_time.py [--model qwen2-vl-2b-random] [--sizes 448,672,896,1000]
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from vlmserve.benchmarks.datasets import random_image
from vlmserve.models.builtin import build_config, build_tokenizer, preprocessor_config
from vlmserve.models.qwen2_vl_processing import Qwen2VLInputProcessor
from vlmserve.models.transformers_processing import TransformersInputProcessor


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2-vl-2b-random")
    ap.add_argument("--sizes", default="448,672,896,1000")
    ap.add_argument("--repeats", type=int, default=16)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:  # tokenizer and processor settings, no weights
        path = Path(tmp)
        tokenizer = build_tokenizer()
        build_config(args.model, tokenizer).save_pretrained(path)
        tokenizer.save_pretrained(path, save_jinja_files=False)
        (path / "preprocessor_config.json").write_text(
            json.dumps(preprocessor_config(args.model)))
        proc = Qwen2VLInputProcessor(path)
        backend = TransformersInputProcessor(path, dtype=torch.bfloat16)
    ids = [proc.image_token_id, 1]
    rng = np.random.default_rng(0)
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        images = [random_image(size, size, rng) for _ in range(args.repeats)]
        proc.process(None, ids, images[:1])  # warm-up
        proc.image_processor(images=images[:1], return_tensors="pt")
        backend.process(None, ids, images[:1])
        t0 = time.perf_counter()
        for im in images:
            proc.process(None, ids, [im])
        t1 = time.perf_counter()
        for im in images:
            proc.image_processor(images=[im], return_tensors="pt")
        t2 = time.perf_counter()
        for im in images:
            backend.process(None, ids, [im])
        t3 = time.perf_counter()
        rows.append({"size": size, "ours_ms": (t1 - t0) / args.repeats * 1e3,
                     "hf_image_processor_ms": (t2 - t1) / args.repeats * 1e3,
                     "transformers_backend_ms": (t3 - t2) / args.repeats * 1e3})
    result = {"image_processor": type(proc.image_processor).__name__,
              "torch_threads": torch.get_num_threads(), "rows": rows}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
