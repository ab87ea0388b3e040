"""Normalisation layers."""

import torch
from torch import nn

from vlmserve.layers.fused import EAGER_OPS


class RMSNorm(nn.Module):
    """`norm(x)`, or with a residual stream `norm(x, residual) -> (norm(x + r), x + r)`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = EAGER_OPS

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
