"""Benchmark request sets: synthetic multimodal (`random-mm`) or a JSONL file."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image


@dataclass
class BenchRequest:
    prompt: dict  # engine prompt input (prompt_token_ids or prompt, multi_modal_data)
    output_len: int
    image_sizes: list[tuple[int, int]] = field(default_factory=list)


def random_image(width: int, height: int, rng: np.random.Generator) -> Image.Image:
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def random_mm(tokenizer, *, num_requests: int, image_sizes: list[int], images_per_request: int,
              prompt_len: int, output_len: int, seed: int = 0) -> list[BenchRequest]:
    """Chat-formatted requests with `images_per_request` random square images (side drawn
    uniformly from `image_sizes`) and `prompt_len` random text tokens each."""
    rng = np.random.default_rng(seed)
    head, tail = _chat_around_text(tokenizer, images_per_request)
    reqs = []
    for _ in range(num_requests):
        sides = [int(rng.choice(image_sizes)) for _ in range(images_per_request)]
        text = rng.integers(32, 127, prompt_len).tolist()  # byte-level ids of printable chars
        ids = head + text + tail
        images = [random_image(s, s, rng) for s in sides]
        reqs.append(BenchRequest({"prompt_token_ids": ids, "multi_modal_data": {"image": images}},
                                 output_len, [(s, s) for s in sides]))
    return reqs


def _chat_around_text(tokenizer, num_images: int) -> tuple[list[int], list[int]]:
    """Token ids of a one-turn user chat before and after its text: Qwen's own format
    (with no system turn, as the benchmarks have always used), else the tokenizer's chat
    template (LLaVA's `USER: <image>\n... ASSISTANT:`, `[INST] <image>\n... [/INST]`), with
    one image placeholder per image."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    if "<|image_pad|>" in tokenizer.get_vocab():
        return (enc("<|im_start|>user\n")
                + enc("<|vision_start|><|image_pad|><|vision_end|>") * num_images,
                enc("<|im_end|>\n<|im_start|>assistant\n"))
    marker = "@@TEXT@@"
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": marker}]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                             add_generation_prompt=True, tokenize=False)
    before, after = rendered.split(marker)
    return tokenizer.encode(before), enc(after)


def jsonl(path: str | Path, output_len: int) -> list[BenchRequest]:
    """Lines of {"prompt": str, "images": [paths], "output_len": int (optional)}; the prompt
    holds one image placeholder per image."""
    reqs = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        images = [Image.open(p).convert("RGB") for p in row.get("images", [])]
        reqs.append(BenchRequest({"prompt": row["prompt"], "multi_modal_data": {"image": images}},
                                 int(row.get("output_len", output_len)),
                                 [im.size for im in images]))
    return reqs
