"""FP8 weights of the language model's projections, kept as a block-wise FP8 checkpoint
stores them: float8 (e4m3) values and one float32 scale per block of rows x columns (the
weight is their product). A `Linear` holding them hands its ops an `Fp8Weight` instead of a
tensor; the eager ops read it back to the activations' dtype for each product, the Triton
ops multiply with it directly (one token: the GEMV of `triton_ops`; more: `triton_fp8`'s
GEMM; FP8 values converted in registers, half the bytes of a bfloat16 weight read).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class Fp8Weight:
    """A [rows, cols] weight: ``q`` (float8) times ``scale`` (float32, one per ``block``)."""

    q: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype`` (computed in float32, as the checkpoint's loader does)."""
        (rows, cols), (br, bc) = self.q.shape, self.block
        full = self.scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
        return (self.q.float() * full).to(dtype)


class HoldsFp8:
    """A projection whose `weight` may be FP8 (`hold_fp8` sets `fp8_block`); `w` is the
    weight as the ops take it: the tensor, or FP8 values with their scales."""

    fp8_block: tuple[int, int] | None = None

    @property
    def w(self) -> torch.Tensor | Fp8Weight:
        if self.fp8_block is None:
            return self.weight
        return Fp8Weight(self.weight, self.weight_scale_inv, self.fp8_block)


def linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, an `Fp8Weight` read back to ``x``'s dtype first (the eager path)."""
    if isinstance(weight, Fp8Weight):
        weight = weight.dequantize(x.dtype)
    return F.linear(x, weight, bias)


def scale_grid(shape: tuple[int, int] | torch.Size, block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def hold_fp8(module: nn.Module, block: tuple[int, int]) -> None:
    """Make ``module`` (a `Linear`, before its weights exist: on the meta device) hold its
    weight as FP8 values and block scales (`weight`, `weight_scale_inv`, the checkpoint's
    names), for the checkpoint to fill."""
    w = module.weight
    module.weight = nn.Parameter(torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device),
                                 requires_grad=False)
    module.weight_scale_inv = nn.Parameter(
        torch.empty(scale_grid(w.shape, block), dtype=torch.float32, device=w.device),
        requires_grad=False)
    module.fp8_block = block
