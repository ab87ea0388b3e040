"""The tiny Hugging Face checkpoints of ``hf_tiny``: each loads through ``AutoProcessor`` and
``AutoModelForImageTextToText`` (without torchvision, except ``NEEDS_TORCHVISION``), generates
varied tokens, and its output depends on the image (one image, and two images in one prompt
where the model allows it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.models.hf_tiny import (
    FLAT_IMAGES,
    MODEL_TYPE,
    NEEDS_TORCHVISION,
    NO_CHAT_TEMPLATE,
    SINGLE_IMAGE,
    TINY_ARCHS,
    build_tiny,
    plain_prompt,
)


def random_image(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _chat(n: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * n
             + [{"type": "text", "text": "Describe the image."}]}]


def _generate(model, processor, images: list[Image.Image], flat: bool = False,
              template: str | None = None):
    if template is None:
        prompt = processor.apply_chat_template(_chat(len(images)), add_generation_prompt=True)
        assert isinstance(prompt, str)
    else:
        prompt = plain_prompt(template, len(images))
    inputs = processor(text=[prompt], images=images if flat else [images],
                       return_tensors="pt")
    if inputs["pixel_values"].is_floating_point():  # Llama 4's processor gives bfloat16
        inputs["pixel_values"] = inputs["pixel_values"].float()
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False, output_scores=True,
                         return_dict_in_generate=True)
    new = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return new, torch.stack(out.scores)[:, 0]


@pytest.mark.parametrize("model_type", [
    pytest.param(m, marks=pytest.mark.skipif(
        m in NEEDS_TORCHVISION and importlib.util.find_spec("torchvision") is None,
        reason="its processor needs torchvision")) for m in sorted(TINY_ARCHS)])
def test_tiny_checkpoint_generates(model_type: str, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    path = build_tiny(model_type, tmp_path / model_type)
    assert AutoConfig.from_pretrained(path).model_type == MODEL_TYPE.get(model_type, model_type)
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    a, b = random_image(40, 30, 1), random_image(30, 44, 2)
    flat = model_type in FLAT_IMAGES
    template = model_type if model_type in NO_CHAT_TEMPLATE else None

    tokens_a, scores_a = _generate(model, processor, [a], flat, template)
    assert len(set(tokens_a)) > 1, tokens_a
    tokens_b, scores_b = _generate(model, processor, [b], flat, template)
    assert tokens_a != tokens_b or not torch.allclose(scores_a, scores_b, atol=1e-3)

    if model_type not in SINGLE_IMAGE:
        tokens_ab, scores_ab = _generate(model, processor, [a, b], flat, template)
        tokens_ba, scores_ba = _generate(model, processor, [b, a], flat, template)
        assert len(set(tokens_ab)) > 1, tokens_ab
        assert tokens_ab != tokens_ba or not torch.allclose(scores_ab, scores_ba, atol=1e-3)
