"""Qwen2.5-VL vision tower: Qwen2-VL's ViT with RMSNorm, gated SiLU MLP and window attention.

Window attention: each frame's grid of merged units (``merge x merge`` patches) is tiled into
windows of ``window_size // patch_size // merge`` units per side (edge windows are smaller).
Patches are reordered window by window before the blocks; layers listed in
``fullatt_block_indexes`` attend over whole frames, the others within windows. The merged
output is put back into the original (raster, merge-block) order.
"""

from __future__ import annotations

import torch
from torch import nn

from vlmserve.models.vision.common import (
    AttnSegments,
    GatedVisionMLP,
    PatchEmbed,
    PatchMerger,
    VisionBlock,
    VisionRotary,
    VisionTowerBase,
    frame_seqlens,
    grid_list,
    merge_order_positions,
    rms_norm,
    rope_theta,
)


def window_partition(
    grids: list[tuple[int, int, int]], merge: int, window_units: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host window layout for a batch of grids.

    Returns:
        unit_order: ``[num_units]`` merged-unit indices sorted by window (raster order inside
            each window), i.e. position ``i`` of the windowed sequence holds unit ``unit_order[i]``.
        window_seqlens: ``[num_windows]`` patches per window, in windowed-sequence order.
    """
    orders, seqlens = [], []
    offset = 0
    for t, h, w in grids:
        lh, lw = h // merge, w // merge
        nwh, nww = -(-lh // window_units), -(-lw // window_units)
        f = torch.arange(t)[:, None, None]
        r = torch.arange(lh)[None, :, None] // window_units
        c = torch.arange(lw)[None, None, :] // window_units
        wid = ((f * nwh + r) * nww + c).flatten()  # [t*lh*lw] window id of each unit
        orders.append(torch.argsort(wid, stable=True) + offset)
        counts = torch.bincount(wid, minlength=t * nwh * nww)  # [t*nwh*nww], all > 0
        seqlens.append(counts * merge**2)
        offset += wid.numel()
    if not orders:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    return torch.cat(orders), torch.cat(seqlens)


class Qwen2_5_VisionTransformer(VisionTowerBase):
    """Qwen2.5-VL vision encoder; parameter names match the checkpoint's ``visual.*`` keys.

    Args:
        vision_config: HF ``Qwen2_5_VLVisionConfig``: ``hidden_size`` (ViT width),
            ``intermediate_size``, ``depth``, ``num_heads``, ``hidden_act``, ``out_hidden_size``,
            ``window_size`` (pixels), ``fullatt_block_indexes``, ``patch_size``,
            ``temporal_patch_size``, ``in_channels``, ``spatial_merge_size``.
    """

    def __init__(self, vision_config) -> None:
        super().__init__()
        cfg = vision_config
        dim = cfg.hidden_size
        self.spatial_merge_size: int = cfg.spatial_merge_size
        self.out_hidden_size: int = cfg.out_hidden_size
        self.window_units: int = cfg.window_size // cfg.patch_size // cfg.spatial_merge_size
        if self.window_units < 1:
            raise ValueError(f"window_size {cfg.window_size} smaller than one merged unit")
        self.fullatt_block_indexes: frozenset[int] = frozenset(cfg.fullatt_block_indexes)
        head_dim = getattr(cfg, "head_dim", None) or dim // cfg.num_heads
        self.patch_embed = PatchEmbed(cfg.patch_size, cfg.temporal_patch_size, cfg.in_channels, dim)
        self.rotary = VisionRotary(head_dim, rope_theta(cfg))
        self.blocks = nn.ModuleList(
            VisionBlock(
                dim,
                cfg.num_heads,
                GatedVisionMLP(dim, cfg.intermediate_size, cfg.hidden_act),
                rms_norm,
            )
            for _ in range(cfg.depth)
        )
        self.merger = PatchMerger(cfg.out_hidden_size, dim, self.spatial_merge_size, rms_norm)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Encode a batch of images/videos.

        Args:
            pixel_values: ``[num_patches, C*T*P*P]``, images concatenated in ``grid_thw`` order.
            grid_thw: ``[num_images, 3]`` patch grid (t, h, w) per image.

        Returns:
            ``[num_patches // merge**2, out_hidden_size]``: image 0's tokens, then image 1's, ...
        """
        device, unit = self.device, self.spatial_merge_size**2
        grids = grid_list(grid_thw)
        pos = merge_order_positions(grids, self.spatial_merge_size)  # [N, 2]
        if pos.shape[0] != pixel_values.shape[0]:
            raise ValueError(
                f"pixel_values has {pixel_values.shape[0]} rows, grid_thw implies {pos.shape[0]}"
            )
        unit_order, window_seqlens = window_partition(
            grids, self.spatial_merge_size, self.window_units
        )
        patch_order = (unit_order[:, None] * unit + torch.arange(unit)).flatten()  # [N]
        full_seg = AttnSegments.build(frame_seqlens(grids), device)  # windows never cross frames
        window_seg = AttnSegments.build(window_seqlens, device)
        # built on the host: copied without waiting for the stream
        pos, patch_order, unit_order = (t.to(device, non_blocking=True)
                                        for t in (pos[patch_order], patch_order, unit_order))
        rotary = self.rotary(pos)  # 2 x [N, head_dim], windowed order

        x = pixel_values.to(device=device, dtype=self.dtype).index_select(
            0, patch_order
        )  # [N, C*T*P*P]
        x = self.patch_embed(x)  # [N, hidden], windowed order
        delta = None
        for i, block in enumerate(self.blocks):
            seg = full_seg if i in self.fullatt_block_indexes else window_seg
            delta, x = block(x, rotary, seg, delta)
        merged = self.merger(x + delta)  # [N / merge^2, out_hidden], windowed order
        return torch.empty_like(merged).index_copy_(0, unit_order, merged)  # original order
