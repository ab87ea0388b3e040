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
    GatedVisionMLP,
    PatchEmbed,
    PatchMerger,
    VisionBlock,
    VisionRotary,
    VisionTowerBase,
    frame_seqlens,
    merge_order_positions,
    rms_norm,
    rope_theta,
)
from vlmserve.models.vision.step_inputs import TowerTensors, VisionInputs


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

    def step_inputs(self, grids: list[tuple[int, int, int]]) -> VisionInputs:
        """Rows in window order: each row's position, the pixel row it reads and each merged
        row's place in the original (raster, merge-block) order; full attention per frame
        (windows never cross frames), the other layers per window."""
        unit = self.spatial_merge_size**2
        pos = merge_order_positions(grids, self.spatial_merge_size)  # [N, 2]
        unit_order, window_seqlens = window_partition(
            grids, self.spatial_merge_size, self.window_units)
        patch_order = (unit_order[:, None] * unit + torch.arange(unit)).flatten()  # [N]
        return VisionInputs(pos[patch_order],
                            {"frames": frame_seqlens(grids), "windows": window_seqlens},
                            unit, gather=patch_order, scatter=unit_order)

    def run(self, pixel_values: torch.Tensor, inputs: TowerTensors) -> torch.Tensor:
        """``[N, C*T*P*P]`` -> ``[N / merge^2, out_hidden]`` in the original order."""
        rotary = self.rotary(inputs.pos)  # 2 x [N, head_dim], windowed order
        full, window = inputs.segments["frames"], inputs.segments["windows"]
        x = pixel_values.to(device=self.device, dtype=self.dtype).index_select(
            0, inputs.gather)  # [N, C*T*P*P], windowed order
        x = self.patch_embed(x)  # [N, hidden]
        delta = None
        for i, block in enumerate(self.blocks):
            seg = full if i in self.fullatt_block_indexes else window
            delta, x = block(x, rotary, seg, delta)
        merged = self.merger(x + delta)  # [N / merge^2, out_hidden], windowed order
        return torch.empty_like(merged).index_copy_(0, inputs.scatter.long(), merged)
