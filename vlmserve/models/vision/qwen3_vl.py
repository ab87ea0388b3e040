"""Qwen3-VL vision tower: ViT with learned position embeddings (bilinearly resampled to each
image's grid) and 2-D rotary, LayerNorm, tanh-GELU MLP, a 2x2 patch merger, and DeepStack:
the outputs of a few early blocks merged too, for the language model's first layers."""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn

from vlmserve.models.vision.common import (
    PatchEmbed,
    VisionBlock,
    VisionRotary,
    VisionTowerBase,
    _grid_positions,
    frame_seqlens,
    get_activation,
    layer_norm,
    merge_order_positions,
    rope_theta,
)
from vlmserve.models.vision.step_inputs import TowerTensors, VisionInputs


class Qwen3VisionMLP(nn.Module):
    """``linear_fc2(act(linear_fc1(x)))``."""

    def __init__(self, dim: int, hidden_dim: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden_dim)
        self.linear_fc2 = nn.Linear(hidden_dim, dim)
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3PatchMerger(nn.Module):
    """Each ``merge x merge`` block to one row: LayerNorm (per patch, or after the shuffle for
    the DeepStack mergers) -> concat -> Linear -> GELU -> Linear."""

    def __init__(self, out_dim: int, dim: int, merge: int, postshuffle: bool) -> None:
        super().__init__()
        self.in_dim = dim * merge**2
        self.postshuffle = postshuffle
        self.norm = layer_norm(self.in_dim if postshuffle else dim)
        self.linear_fc1 = nn.Linear(self.in_dim, self.in_dim)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(self.in_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.in_dim)) if self.postshuffle else self.norm(x).reshape(
            -1, self.in_dim)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


@lru_cache(maxsize=256)
def _position_taps(h: int, w: int, merge: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Host ``([h*w, 4] indices, [h*w, 4] weights)`` into a ``side x side`` learned table that
    resample it bilinearly (corners aligned) to an ``h x w`` grid, patches in merge order."""
    pos = _grid_positions(1, h, w, merge).double()

    def axis(coord: torch.Tensor, size: int) -> tuple[torch.Tensor, ...]:
        x = coord * ((side - 1) / (size - 1)) if size > 1 else torch.zeros_like(coord)
        lo = x.floor().clamp(0, side - 1)
        return lo.long(), (lo + 1).clamp(max=side - 1).long(), x - lo

    r0, r1, fr = axis(pos[:, 0], h)
    c0, c1, fc = axis(pos[:, 1], w)
    index = torch.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1], 1)
    weight = torch.stack([(1 - fr) * (1 - fc), (1 - fr) * fc, fr * (1 - fc), fr * fc], 1)
    return index, weight.float()


class Qwen3VisionTransformer(VisionTowerBase):
    """Qwen3-VL vision encoder; parameter names match the checkpoint's ``visual.*`` keys.

    Each output row is the merged row (``out_hidden_size`` of the config) followed by one
    DeepStack row per `deepstack_visual_indexes` entry, so ``out_hidden_size`` here is
    ``(1 + len(deepstack_visual_indexes))`` times the language model's hidden size.
    """

    def __init__(self, vision_config) -> None:
        super().__init__()
        cfg = vision_config
        dim = cfg.hidden_size
        self.spatial_merge_size: int = cfg.spatial_merge_size
        # Qwen3.5's tower has none
        self.deepstack_indexes: list[int] = list(getattr(cfg, "deepstack_visual_indexes", ()))
        self.out_hidden_size: int = cfg.out_hidden_size * (1 + len(self.deepstack_indexes))
        head_dim = dim // cfg.num_heads
        self.patch_embed = PatchEmbed(cfg.patch_size, cfg.temporal_patch_size, cfg.in_channels,
                                      dim, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, dim)
        self.side = int(cfg.num_position_embeddings**0.5)
        self.rotary = VisionRotary(head_dim, rope_theta(cfg))
        self.blocks = nn.ModuleList(
            VisionBlock(dim, cfg.num_heads,
                        Qwen3VisionMLP(dim, cfg.intermediate_size, cfg.hidden_act), layer_norm)
            for _ in range(cfg.depth))
        merge = self.spatial_merge_size
        self.merger = Qwen3PatchMerger(cfg.out_hidden_size, dim, merge, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(cfg.out_hidden_size, dim, merge, postshuffle=True)
            for _ in self.deepstack_indexes)

    def step_inputs(self, grids: list[tuple[int, int, int]]) -> VisionInputs:
        """Each row's rotary position and its taps into the learned position table."""
        taps = [_position_taps(h, w, self.spatial_merge_size, self.side) for _, h, w in grids]
        index = [i.repeat(t, 1) for (t, _, _), (i, _) in zip(grids, taps, strict=True)]
        weight = [wt.repeat(t, 1) for (t, _, _), (_, wt) in zip(grids, taps, strict=True)]
        return VisionInputs(
            merge_order_positions(grids, self.spatial_merge_size),
            {"frames": frame_seqlens(grids)}, self.spatial_merge_size**2,
            tap_index=torch.cat(index) if index else torch.zeros(0, 4, dtype=torch.long),
            tap_weight=torch.cat(weight) if weight else torch.zeros(0, 4))

    def run(self, pixel_values: torch.Tensor, inputs: TowerTensors) -> torch.Tensor:
        """``[N, C*T*P*P]`` -> ``[N / merge^2, out_hidden_size]`` (merged | DeepStack rows)."""
        rotary = self.rotary(inputs.pos)
        seg = inputs.segments["frames"]
        x = self.patch_embed(pixel_values.to(device=self.device, dtype=self.dtype))
        table = self.pos_embed(inputs.tap_index)  # [N, 4, dim]
        x = x + (table * inputs.tap_weight[:, :, None].to(table.dtype)).sum(1).to(x.dtype)
        delta, deep = None, []
        for i, block in enumerate(self.blocks):
            delta, x = block(x, rotary, seg, delta)
            if i in self.deepstack_indexes:
                merger = self.deepstack_merger_list[self.deepstack_indexes.index(i)]
                deep.append(merger(x + delta))
        return torch.cat([self.merger(x + delta), *deep], dim=-1)
