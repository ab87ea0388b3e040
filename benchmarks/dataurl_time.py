"""Host time of a front end's preprocessing of a chat prompt whose image arrives as a
``data:image/png;base64,`` URL, as `vlmserve bench serve` sends it: base64, PNG decoding,
hashing, resizing and tokenization (`InputProcessor.process`), per image size (CPU only).

    python benchmarks/dataurl_time.py [--model qwen2-vl-2b-random] [--sizes 448,896] [--profile]
"""

import argparse
import base64
import cProfile
import io
import json
import pstats
import time

import numpy as np

from vlmserve.benchmarks.datasets import random_image
from vlmserve.inputs.chat import parse_chat_messages
from vlmserve.inputs.processor import InputProcessor
from vlmserve.models.metadata import load_model_processor, text_config
from vlmserve.multimodal.image import load_image


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2-vl-2b-random")
    ap.add_argument("--sizes", default="448,672,896")
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    _, hf_config, processor = load_model_processor(args.model)
    text = text_config(hf_config)
    ip = InputProcessor(processor, text.vocab_size, text.hidden_size, 0)
    rng = np.random.default_rng(0)
    results = []
    for side in [int(s) for s in args.sizes.split(",")]:
        urls = []
        for _ in range(args.repeats + 1):
            buf = io.BytesIO()
            random_image(side, side, rng).save(buf, format="PNG")
            urls.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
        prompts = []
        for u in urls:  # the server's chat path: template, then the image sources
            hf_messages, images = parse_chat_messages([{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": u}},
                {"type": "text", "text": "Describe this."}]}])
            prompts.append({"prompt": processor.apply_chat_template(hf_messages),
                            "multi_modal_data": {"image": images}})
        ip.process(prompts[0], load_image)  # untimed
        prof = cProfile.Profile() if args.profile else None
        start = time.perf_counter()
        if prof:
            prof.enable()
        for p in prompts[1:]:
            ip.process(p, load_image)
        if prof:
            prof.disable()
        ms = (time.perf_counter() - start) / args.repeats * 1e3
        results.append({"size": side, "ms_per_request": ms})
        if prof:
            pstats.Stats(prof).sort_stats("tottime").print_stats(8)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
