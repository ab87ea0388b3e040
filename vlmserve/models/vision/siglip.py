"""SigLIP ViT vision tower (Gemma 3's): patch embedding with a bias, learned position
embeddings, no class token, pre-norm blocks (CLIP's: biased attention, a `hidden_act` MLP),
a final LayerNorm. Every image of a batch is the config's ``image_size``: one dense SDPA per
layer, no packing. The pooling head (``vision_use_head``) is not built."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vlmserve.layers.norm import LayerNorm
from vlmserve.models.vision.clip import CLIPEncoderLayer, FixedSizeTower, load_tower_weights


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        dim, p = cfg.hidden_size, cfg.patch_size
        self.image_size = cfg.image_size
        self.patch_embedding = nn.Conv2d(cfg.num_channels, dim, kernel_size=p, stride=p)
        self.position_embedding = nn.Embedding((cfg.image_size // p) ** 2, dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[B, C, S, S]`` -> ``[B, (S/p)^2, dim]``."""
        if pixel_values.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(f"SigLIP tower takes {self.image_size}x{self.image_size} images, "
                             f"got {tuple(pixel_values.shape[-2:])}")
        w = self.patch_embedding.weight
        x = self.patch_embedding(pixel_values.to(w.dtype)).flatten(2).transpose(1, 2)
        return x + self.position_embedding.weight


class SiglipVisionTower(FixedSizeTower):
    """Last hidden state of the SigLIP ViT, after ``post_layernorm``. Parameter names are the
    checkpoint's relative to ``vision_tower.vision_model.``."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.patch_size, self.image_size = cfg.patch_size, cfg.image_size
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(CLIPEncoderLayer(cfg)
                                            for _ in range(cfg.num_hidden_layers))
        self.post_layernorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_image(self) -> int:
        return self.patches_per_side ** 2

    def run(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[B, C, S, S]`` -> ``[B, patches, dim]``."""
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Names relative to the tower (a leading ``vision_model.`` dropped); the pooling
        head's are skipped."""
        return load_tower_weights(self, weights, lambda name: name.startswith("head."))
