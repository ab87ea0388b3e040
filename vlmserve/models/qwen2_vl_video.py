"""The video processor settings of a Qwen2-VL-family checkpoint, read as transformers reads
them (`AutoVideoProcessor`'s fallbacks, each class's normalization defaults)."""

from __future__ import annotations

import json
from pathlib import Path

from vlmserve.models.processing import NormalizedPixels


def video_processor_config(path: Path) -> dict:
    """The settings transformers' video processor loads for the checkpoint: its
    video_preprocessor_config.json, else processor_config.json's ``video_processor``, else the
    image processor's preprocessor_config.json (as `AutoVideoProcessor` falls back)."""
    for name, key in (("video_preprocessor_config.json", None),
                      ("processor_config.json", "video_processor"),
                      ("preprocessor_config.json", None)):
        try:
            with open(path / name) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        data = data.get(key) if key else data
        if isinstance(data, dict):
            return data
    return {}


def video_normalization(video: dict, qwen3: bool) -> NormalizedPixels:
    """A video processor's rescale and normalize from its settings (``video``), with its
    class's defaults (Qwen2VLVideoProcessor: CLIP's mean and std; Qwen3VLVideoProcessor:
    0.5 and 0.5), in the fused order of transformers' video processors (torchvision)."""
    from transformers.utils.constants import (
        IMAGENET_STANDARD_MEAN,
        IMAGENET_STANDARD_STD,
        OPENAI_CLIP_MEAN,
        OPENAI_CLIP_STD,
    )

    def three(value, default) -> tuple[float, ...]:
        value = default if value is None else value
        return tuple(map(float, value if isinstance(value, (list, tuple)) else [value] * 3))

    mean, std = ((IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD) if qwen3
                 else (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD))
    normalize = video.get("do_normalize", True)
    return NormalizedPixels(
        rescale_factor=(float(video.get("rescale_factor", 1 / 255))
                        if video.get("do_rescale", True) else None),
        mean=three(video.get("image_mean"), mean) if normalize else None,
        std=three(video.get("image_std"), std) if normalize else None,
        fused=True)
