"""Qwen2-VL and Qwen2.5-VL: a vision tower, the Qwen2 language model with mRoPE, an lm_head."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from vlmserve.layers.positions import MRopePositions
from vlmserve.models.qwen2 import DecoderVLM
from vlmserve.models.qwen2_vl_processing import Qwen2VLInputProcessor
from vlmserve.models.vision.qwen2_5_vl import Qwen2_5_VisionTransformer
from vlmserve.models.vision.qwen2_vl import Qwen2VisionTransformer


def text_config(hf_config):
    return getattr(hf_config, "text_config", None) or hf_config


class QwenVisionEncoder(nn.Module):
    """The vision tower alone, as an encoder service runs it (`build_encoder`): checkpoint
    names in (`load_weights`), embedding rows out."""

    def __init__(self, tower: nn.Module) -> None:
        super().__init__()
        self.visual = tower
        self.out_hidden_size: int = tower.out_hidden_size

    def forward(self, pixel_values: torch.Tensor,
                encoder_meta: Sequence[tuple[int, ...]]) -> torch.Tensor:
        return self.visual(pixel_values, torch.tensor(encoder_meta, dtype=torch.int64))

    def load_weights(self, weights) -> set[str]:
        vision = [(name.split("visual.", 1)[1], t) for name, t in weights
                  if name.startswith(("model.visual.", "visual."))]
        return {f"visual.{n}" for n in self.visual.load_weights(vision)}

    def set_attention_backend(self, fn) -> None:
        self.visual.set_attention_backend(fn)


class Qwen2VLForConditionalGeneration(DecoderVLM):
    # mRoPE: the processor computes a prompt's three position rows
    position_scheme = MRopePositions()
    input_processor_cls = Qwen2VLInputProcessor
    vision_cls: type[nn.Module] = Qwen2VisionTransformer
    # checkpoint names an encoder service reads (hub and transformers 5.x layouts)
    encoder_prefixes = ("model.visual.", "visual.")

    @classmethod
    def build_encoder(cls, hf_config) -> QwenVisionEncoder:
        """The image encoder alone (no language model), for `vlmserve.MultimodalEncoder`."""
        return QwenVisionEncoder(cls.vision_cls(hf_config.vision_config))

    def __init__(self, hf_config) -> None:
        super().__init__()
        self.config = hf_config
        tcfg = text_config(hf_config)
        self.visual = self.vision_cls(hf_config.vision_config)
        self._init_language_model(tcfg)

    def encode_images(self, pixel_values: torch.Tensor,
                      encoder_meta: Sequence[tuple[int, ...]]) -> torch.Tensor:
        """``encoder_meta``: each image's patch grid (t, h, w), kept on the host (the tower
        plans its launches from it without a device sync)."""
        grid = torch.tensor(encoder_meta, dtype=torch.int64)  # [N, 3]
        return self.visual(pixel_values, grid)  # [sum(t*h*w) / merge^2, hidden]

    def set_vision_attention_backend(self, fn) -> None:
        self.visual.set_attention_backend(fn)

    def load_weights(self, weights) -> set[str]:
        """Accepts the hub layout (`visual.*`, `model.*`, `lm_head.*`) and the transformers 5.x
        layout (`model.visual.*`, `model.language_model.*`, `lm_head.*`)."""
        vision, text, loaded = [], [], set()
        for name, tensor in weights:
            if name.startswith(("model.visual.", "visual.")):
                vision.append((name.split("visual.", 1)[1], tensor))
            elif name.startswith("model.language_model."):
                text.append((name[len("model.language_model."):], tensor))
            elif name.startswith("model."):
                text.append((name[len("model."):], tensor))
            elif name == "lm_head.weight":
                if not self.tie_word_embeddings:
                    with torch.no_grad():
                        self.lm_head.weight.copy_(tensor)
                loaded.add("lm_head.weight")
            else:
                raise KeyError(f"unexpected checkpoint weight {name!r}")
        loaded |= {f"visual.{n}" for n in self.visual.load_weights(vision)}
        loaded |= {f"language_model.{n}" for n in self.language_model.load_weights(text)}
        if self.tie_word_embeddings:
            loaded.add("lm_head.weight")
        return loaded


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    vision_cls = Qwen2_5_VisionTransformer
