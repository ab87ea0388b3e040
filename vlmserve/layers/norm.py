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


class LayerNorm(nn.Module):
    """`nn.LayerNorm` over the last dim (same parameters) with RMSNorm's residual form:
    `norm(x, residual) -> (norm(x + r), x + r)`, one kernel with the Triton ops."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps
        self.ops = EAGER_OPS

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.layer_norm(x, self.weight, self.bias, self.eps)
        return self.ops.add_layer_norm(x, residual, self.weight, self.bias, self.eps)
