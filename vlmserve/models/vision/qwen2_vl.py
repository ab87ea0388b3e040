"""Qwen2-VL vision tower (ViT with 2-D rotary, LayerNorm, quick-GELU MLP, 2x2 patch merger)."""

from __future__ import annotations

import torch
from torch import nn

from vlmserve.models.vision.common import (
    PatchEmbed,
    PatchMerger,
    VisionBlock,
    VisionMLP,
    VisionRotary,
    VisionTowerBase,
    frame_seqlens,
    layer_norm,
    merge_order_positions,
    rope_theta,
)
from vlmserve.models.vision.step_inputs import TowerTensors, VisionInputs


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

    def step_inputs(self, grids: list[tuple[int, int, int]]) -> VisionInputs:
        return VisionInputs(merge_order_positions(grids, self.spatial_merge_size),
                            {"frames": frame_seqlens(grids)}, self.spatial_merge_size**2)

    def run(self, pixel_values: torch.Tensor, inputs: TowerTensors) -> torch.Tensor:
        """``[N, C*T*P*P]`` -> ``[N / merge^2, out_hidden]``."""
        rotary = self.rotary(inputs.pos)  # 2 x [N, head_dim]
        seg = inputs.segments["frames"]
        x = self.patch_embed(pixel_values.to(device=self.device, dtype=self.dtype))  # [N, embed]
        delta = None
        for block in self.blocks:
            delta, x = block(x, rotary, seg, delta)
        return self.merger(x + delta)
