"""Qwen3-VL: the Qwen3-VL vision tower, the Qwen3 language model (per-head q/k norms,
interleaved mRoPE), and DeepStack: each image row carries, beside its embedding, the merged
outputs of a few early vision blocks, added to the hidden states of the first layers."""

from __future__ import annotations

import torch

from vlmserve.models.qwen2_vl import Qwen2VLForConditionalGeneration
from vlmserve.models.vision.qwen3_vl import Qwen3VisionTransformer


class Qwen3VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    vision_cls = Qwen3VisionTransformer

    @classmethod
    def image_row_width(cls, hf_config) -> int:
        """An image row: its embedding, then one DeepStack row per `deepstack_visual_indexes`
        entry (the store, offload and encoder services move them as one row)."""
        vision = hf_config.vision_config
        return vision.out_hidden_size * (1 + len(vision.deepstack_visual_indexes))

    def merge_image_rows(self, embeds: torch.Tensor, dest: torch.Tensor,
                         rows: torch.Tensor) -> dict:
        hidden = self.hidden_size
        embeds.index_copy_(0, dest, rows[:, :hidden].to(embeds.dtype))
        deep = rows[:, hidden:].to(embeds.dtype)
        return {"deepstack": (dest, deep.reshape(rows.shape[0], -1, hidden))}
