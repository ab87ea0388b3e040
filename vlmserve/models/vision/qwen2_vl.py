"""Qwen2-VL vision tower (ViT with 2-D rotary, LayerNorm, quick-GELU MLP, 2x2 patch merger)."""

from __future__ import annotations

import torch
from torch import nn

from vlmserve.models.vision.common import (
    AttnSegments,
    PatchEmbed,
    PatchMerger,
    VisionBlock,
    VisionMLP,
    VisionRotary,
    VisionTowerBase,
    frame_seqlens,
    grid_list,
    layer_norm,
    merge_order_positions,
    rope_theta,
)


class Qwen2VisionTransformer(VisionTowerBase):
    """Qwen2-VL vision encoder; parameter names match the checkpoint's ``visual.*`` keys.

    Args:
        vision_config: HF ``Qwen2VLVisionConfig`` (``config.vision_config``): ``embed_dim``,
            ``depth``, ``num_heads``, ``mlp_ratio``, ``hidden_act``, ``hidden_size`` (output
            width), ``patch_size``, ``temporal_patch_size``, ``in_channels``,
            ``spatial_merge_size``.
    """

    def __init__(self, vision_config) -> None:
        super().__init__()
        cfg = vision_config
        dim = cfg.embed_dim
        self.spatial_merge_size: int = cfg.spatial_merge_size
        self.out_hidden_size: int = cfg.hidden_size
        head_dim = getattr(cfg, "head_dim", None) or dim // cfg.num_heads
        self.patch_embed = PatchEmbed(cfg.patch_size, cfg.temporal_patch_size, cfg.in_channels, dim)
        self.rotary = VisionRotary(head_dim, rope_theta(cfg))
        hidden = int(dim * cfg.mlp_ratio)
        self.blocks = nn.ModuleList(
            VisionBlock(dim, cfg.num_heads, VisionMLP(dim, hidden, cfg.hidden_act), layer_norm)
            for _ in range(cfg.depth)
        )
        self.merger = PatchMerger(cfg.hidden_size, dim, self.spatial_merge_size, layer_norm)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Encode a batch of images/videos.

        Args:
            pixel_values: ``[num_patches, C*T*P*P]``, images concatenated in ``grid_thw`` order.
            grid_thw: ``[num_images, 3]`` patch grid (t, h, w) per image.

        Returns:
            ``[num_patches // merge**2, out_hidden_size]``: image 0's tokens, then image 1's, ...
        """
        device = self.device
        grids = grid_list(grid_thw)
        pos = merge_order_positions(grids, self.spatial_merge_size).to(device, non_blocking=True)
        if pos.shape[0] != pixel_values.shape[0]:
            raise ValueError(
                f"pixel_values has {pixel_values.shape[0]} rows, grid_thw implies {pos.shape[0]}"
            )
        seg = AttnSegments.build(frame_seqlens(grids), device)
        rotary = self.rotary(pos)  # 2 x [N, head_dim]

        x = self.patch_embed(pixel_values.to(device=device, dtype=self.dtype))  # [N, embed]
        delta = None
        for block in self.blocks:
            delta, x = block(x, rotary, seg, delta)
        return self.merger(x + delta)  # [N / merge^2, out_hidden]
