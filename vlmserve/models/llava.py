"""LLaVA-1.5: CLIP ViT tower -> two-layer projector -> Llama decoder (plain 1-D RoPE) -> lm_head."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from vlmserve.layers.positions import TokenPositions
from vlmserve.models.llava_processing import LlavaInputProcessor, tokens_per_image
from vlmserve.models.qwen2 import DecoderVLM
from vlmserve.models.vision.clip import CLIPVisionTower
from vlmserve.models.vision.common import get_activation


class LlavaProjector(nn.Module):
    """``linear_2(act(linear_1(x)))``: vision features to the LM's width."""

    def __init__(self, in_dim: int, out_dim: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, out_dim, bias=bias)
        self.linear_2 = nn.Linear(out_dim, out_dim, bias=bias)
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(DecoderVLM):
    position_scheme = TokenPositions()
    input_processor_cls = LlavaInputProcessor
    # checkpoint names an encoder service reads (hub and transformers 5.x layouts)
    encoder_prefixes = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                        "multi_modal_projector.")

    def __init__(self, hf_config) -> None:
        super().__init__()
        self.config = hf_config
        tcfg = hf_config.text_config
        self._init_vision(hf_config)
        self._init_language_model(tcfg)

    def _init_vision(self, hf_config) -> None:
        """The image encoder's modules (tower and projector) on ``self`` (a model, or a
        `LlavaEncoder`)."""
        strategy = hf_config.vision_feature_select_strategy
        self.vision_tower = CLIPVisionTower(hf_config.vision_config,
                                            hf_config.vision_feature_layer,
                                            keep_cls=strategy == "full")
        assert self.vision_tower.tokens_per_image == tokens_per_image(hf_config)
        self.multi_modal_projector = LlavaProjector(
            self.vision_tower.out_dim, hf_config.text_config.hidden_size,
            hf_config.projector_hidden_act,
            bool(getattr(hf_config, "multimodal_projector_bias", True)))

    @classmethod
    def build_encoder(cls, hf_config) -> LlavaEncoder:
        """The image encoder alone (no language model), for `vlmserve.MultimodalEncoder`."""
        return LlavaEncoder(cls, hf_config)

    def encode_images(self, pixel_values: torch.Tensor,
                      encoder_meta: Sequence[tuple[int, ...]]) -> torch.Tensor:
        """``[B, 3, S, S]`` (all images one size; ``encoder_meta`` empty) -> ``[B * tokens,
        hidden]``, image by image."""
        feats = self.vision_tower(pixel_values)  # [B, tokens, vision_dim * layers]
        return self.multi_modal_projector(feats).flatten(0, 1)  # [B * tokens, hidden]

    def set_vision_attention_backend(self, fn) -> None:
        """Unused: every CLIP batch is images of one size, one dense SDPA call."""

    def load_weights(self, weights) -> set[str]:
        """Accepts the hub layout (`vision_tower.vision_model.*`, `multi_modal_projector.*`,
        `language_model.model.*`, `language_model.lm_head.*`) and the transformers 5.x one
        (`model.vision_tower.*`, `model.multi_modal_projector.*`, `model.language_model.*`,
        `lm_head.*`)."""
        vision, text, loaded = [], [], set()
        projector = dict(self.multi_modal_projector.named_parameters())
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith("vision_tower."):
                vision.append((name[len("vision_tower."):], tensor))
            elif name.startswith("multi_modal_projector."):
                key = name[len("multi_modal_projector."):]
                if key not in projector:
                    raise KeyError(f"unexpected checkpoint weight {name!r}")
                with torch.no_grad():
                    projector[key].copy_(tensor)
                loaded.add(f"multi_modal_projector.{key}")
            elif name in ("lm_head.weight", "language_model.lm_head.weight"):
                if not self.tie_word_embeddings:
                    with torch.no_grad():
                        self.lm_head.weight.copy_(tensor)
                loaded.add("lm_head.weight")
            elif name.startswith("language_model."):
                text.append((name[len("language_model."):].removeprefix("model."), tensor))
            else:
                raise KeyError(f"unexpected checkpoint weight {name!r}")
        loaded |= {f"vision_tower.{n}" for n in self.vision_tower.load_weights(vision)}
        loaded |= {f"language_model.{n}" for n in self.language_model.load_weights(text)}
        if self.tie_word_embeddings:
            loaded.add("lm_head.weight")
        return loaded


class LlavaEncoder(nn.Module):
    """A LLaVA family model's image encoder alone (tower, projector and what the model's
    `encode_images` reads), as an encoder service runs it: the model class's own
    `_init_vision` and `encode_images` on this module, so the rows are the model's."""

    def __init__(self, model_cls: type[LlavaForConditionalGeneration], hf_config) -> None:
        super().__init__()
        self._encode = model_cls.encode_images
        model_cls._init_vision(self, hf_config)
        self.out_hidden_size: int = hf_config.text_config.hidden_size

    def forward(self, pixel_values: torch.Tensor,
                encoder_meta: Sequence[tuple[int, ...]]) -> torch.Tensor:
        return self._encode(self, pixel_values, encoder_meta)

    def load_weights(self, weights) -> set[str]:
        """The tower's, the projector's (and ``image_newline``) from checkpoint names."""
        params = dict(self.named_parameters())
        vision, loaded = [], set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith("vision_tower."):
                vision.append((name[len("vision_tower."):], tensor))
            elif name in params:
                with torch.no_grad():
                    params[name].copy_(tensor)
                loaded.add(name)
        return loaded | {f"vision_tower.{n}" for n in self.vision_tower.load_weights(vision)}

    def set_attention_backend(self, fn) -> None:
        """Unused: every CLIP batch is images of one size, one dense SDPA call."""
