"""Demo: a batch of multimodal chat requests on the built-in tiny model, outputs printed."""

from __future__ import annotations

import argparse

import numpy as np
from PIL import Image

from vlmserve import LLM, SamplingParams


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny-qwen2-vl")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    llm = LLM(args.model, max_num_batched_tokens=64)
    conversations = [
        [{"role": "user", "content": [{"type": "image", "image": _image(112, 84, 0)},
                                      {"type": "text", "text": "What is in this picture?"}]}],
        [{"role": "user", "content": [{"type": "image", "image": _image(56, 56, 1)},
                                      {"type": "image", "image": _image(140, 112, 2)},
                                      {"type": "text", "text": "Compare these two images."}]}],
        [{"role": "user", "content": "Write one sentence about the sea."}],
    ]
    outs = llm.chat(conversations, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    for out in outs:
        c = out.outputs[0]
        print(f"--- request {out.request_id}: {len(out.prompt_token_ids)} prompt tokens, "
              f"{len(c.token_ids)} output tokens, finish_reason={c.finish_reason}")
        print(repr(c.text))
    print("(random tiny weights: the text is noise; the engine path is the real one)")


if __name__ == "__main__":
    main()
