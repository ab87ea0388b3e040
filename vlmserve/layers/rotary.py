"""Rotary position embedding for the language model, with mRoPE sections (Qwen2-VL, Qwen3-VL).

With mRoPE each token has three positions (temporal, height, width); the rotary frequencies
are split into `mrope_section` parts and part i takes its angle from position row i % 3.
Text tokens have three equal positions, which makes mRoPE the ordinary 1-D RoPE.
"""

import torch
from torch import nn


class MRotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, base: float, mrope_section: list[int] | None,
                 interleaved: bool = False) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.mrope_section = list(mrope_section) if mrope_section else None
        if self.mrope_section:
            assert sum(self.mrope_section) == head_dim // 2, "mrope_section must sum to head_dim/2"
            # for each frequency, which position row (0=t, 1=h, 2=w) drives it: contiguous
            # sections (Qwen2-VL), or interleaved t h w t h w ... while each section lasts
            # (Qwen3-VL: frequency j is h's if j % 3 == 1 and j < 3 * sections[1], w's alike)
            if interleaved:
                j = torch.arange(head_dim // 2)
                rows = torch.zeros_like(j)
                for r in (1, 2):
                    rows[(j % 3 == r) & (j < 3 * self.mrope_section[r])] = r
            else:
                rows = torch.cat([torch.full((n,), i % 3)
                                  for i, n in enumerate(self.mrope_section)])
            self.register_buffer("section_rows", rows, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions: [3, T] (mRoPE) or [T] -> cos, sin: [T, head_dim]."""
        inv_freq = self.inv_freq.float()
        if positions.dim() == 1:
            freqs = positions.float()[:, None] * inv_freq  # [T, D/2]
        else:
            if self.mrope_section is None:
                positions = positions[0]
                freqs = positions.float()[:, None] * inv_freq
            else:
                pos = positions.float()[self.section_rows]  # [D/2, T]
                freqs = pos.t() * inv_freq  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)
