"""Qwen3-VL-MoE: Qwen3-VL whose language model's MLPs are sparse mixtures of experts
(`layers/moe.py`; the decoder picks them per layer from the config)."""

from __future__ import annotations

from vlmserve.models.qwen3_vl import Qwen3VLForConditionalGeneration


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    pass
